"""`tessera serve` under torchrun with --tensor-model-parallel-size 2 (gloo, CPU), and the lockstep protocol.

Oracle for the answers: a single-process engine over the same model, greedy. Between the
answers checked, a request is refused and a stream is dropped mid-way (an abort that rank 0
must pass on): the answers after them show the ranks still in step. SIGTERM to torchrun (as
a scheduler or Ctrl-C sends it) must end every rank cleanly.
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import torch.distributed as dist

from tessera.inference.lockstep import ABORT, ADD, TensorParallel
from tessera.inference.sampling import SamplingParams
from tests.dist.launcher import run_distributed
from tests.inference.tiny_text_model import hf_dir, tiny_engine, tokenizer  # noqa: F401 -- fixtures
from tests.ports import free_port

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
PROMPTS = ["The quick brown", "héllo wörld", "def main():", "tessera trains"]
NEW_TOKENS = 10


def _wait_until_up(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[0][-3000:]
        try:
            if httpx.get(base + "/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server did not come up")


def _complete(base: str, prompt: str) -> list[int]:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(base + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def _drop_a_stream(base: str) -> None:
    body = {"prompt": "The quick", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break   # leave after the first chunk: the server aborts the request


def _worker_pids(launcher_pid: int) -> list[int]:
    return [int(pid) for pid in open(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read().split()]


def test_torchrun_tp2_serve_answers_as_one_process_and_stops_on_sigterm(hf_dir, tokenizer):
    reference = tiny_engine(hf_dir, tokenizer, max_requests=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    expected = [c.token_ids for c in reference.generate([tokenizer.encode(p) for p in PROMPTS], params)]

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*TORCHRUN, "-m", "tessera", "serve", "--hf", str(hf_dir), "--port", str(port),
                               "--tensor-model-parallel-size", "2", "--inference-max-requests", "8"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_until_up(base, server)
        workers = _worker_pids(server.pid)
        assert len(workers) == 2
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda prompt: _complete(base, prompt), PROMPTS)) == expected
        too_long = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1000})
        assert too_long.status_code == 400   # refused on rank 0: never sent to rank 1
        _drop_a_stream(base)
        assert _complete(base, PROMPTS[1]) == expected[1]
        server.send_signal(signal.SIGTERM)
        log = server.communicate(timeout=60)[0]
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    # torchrun itself reports the signal; the ranks must not: no traceback, no lost peer
    assert "[rank" not in log and "Connection closed" not in log, log[-3000:]
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]


def _lockstep_worker() -> tuple[list, list]:
    rank = dist.get_rank()
    parallel = TensorParallel(rank, "cpu", dist.new_group(backend="gloo"))
    commands = [(ADD, "a", [1, 2, 3], SamplingParams(max_tokens=3, seed=4)), (ABORT, "b")]
    received = [parallel.broadcast_commands(commands if rank == 0 else ()), parallel.broadcast_commands()]

    class Cache:
        def __init__(self, num_blocks):
            self.num_blocks = num_blocks

    made = []

    def make_engine(num_blocks):
        made.append(num_blocks)
        return type("FakeEngine", (), {"cache": Cache(num_blocks or 10 - 3 * rank)})()

    engine = parallel.agree_on_cache(make_engine)
    return received, [made, engine.cache.num_blocks]


def test_commands_reach_every_rank_and_the_kv_cache_is_the_smallest_ranks():
    rank0, rank1 = run_distributed(_lockstep_worker, 2)
    commands = [(ADD, "a", [1, 2, 3], SamplingParams(max_tokens=3, seed=4)), (ABORT, "b")]
    assert rank0[0] == rank1[0] == [commands, []]
    # rank 0's default cache (10 blocks) is larger than rank 1's (7): it builds again with 7
    assert rank0[1] == [[None, 7], 7] and rank1[1] == [[None], 7]

"""Launching as clusters do: SLURM's variables, the start-up check, timeouts and the shared index cache.

Each test starts `python -m tessera train` processes with torchrun's (or SLURM's) variables
set by hand, as a multi-node launcher would, so that one process can be left out, stopped
or given other flags.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tessera.config import ParallelConfig
from tessera.data.indexed import IndexedDatasetWriter
from tessera.parallel.mesh import Mesh
from tests.dist.launcher import run_distributed
from tests.ports import free_port

TINY = ["--model", "tiny-llama", "--mock-data", "--lr", "3e-3", "--micro-batch-size", "2", "--log-interval", "1",
        "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


def start(rank: int, world_size: int, port: int, flags: list[str], *, environ: dict | None = None,
          command: list[str] | None = None, local_rank: int | None = None) -> subprocess.Popen:
    """One rank of a job whose launcher set torchrun's variables (or `environ` instead)."""
    variables = environ if environ is not None else {
        "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT") and not k.startswith("SLURM_")}
    process = subprocess.Popen(command or [sys.executable, "-m", "tessera", "train", *flags],
                               env={**clean, **variables, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    _started.append(process)
    return process


_started: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_leftover_ranks():
    """A test that fails with ranks still running stops them: left alone they hold the CPU
    (and their ports) through the rest of the suite."""
    yield
    while _started:
        process = _started.pop()
        if process.poll() is None:
            process.kill()
            process.communicate()


def finish(process: subprocess.Popen) -> tuple[int, str]:
    """The rank's exit code and last line of stderr; a rank still running after 180 s fails
    the test with its stderr."""
    try:
        _, err = process.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"rank still running after 180 s; its stderr:\n{err[-3000:]}") from None
    return process.returncode, err.strip().splitlines()[-1] if err.strip() else ""


def test_slurm_launch_without_torchrun_matches_one_process(tmp_path):
    flags = [*TINY, "--train-iters", "3", "--global-batch-size", "4"]
    single = start(0, 1, 0, [*flags, "--log-json", str(tmp_path / "one.jsonl")], environ={})
    job = {"SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": str(free_port())}
    ranks = [start(r, 2, 0, [*flags, "--log-json", str(tmp_path / "two.jsonl"), "--log-straggler"],
                   environ={**job, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in (0, 1)]
    assert [finish(p)[0] for p in (single, ranks[0])] == [0, 0]
    out, err = ranks[1].communicate(timeout=180)   # the last rank writes the log
    assert ranks[1].returncode == 0, err[-2000:]
    reports = [line for line in out.splitlines() if line.startswith(" straggler:")]
    assert len(reports) == 3 and all(f"rank {r} ({socket.gethostname()})" in reports[0] for r in (0, 1)), reports
    one, two = ([json.loads(line)["loss"] for line in (tmp_path / f"{n}.jsonl").read_text().splitlines()]
                for n in ("one", "two"))
    assert len(two) == 3 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(one, two)), (one, two)


def test_a_rank_that_never_joins_is_named_within_the_timeout():
    began = time.monotonic()
    code, line = finish(start(0, 3, free_port(), [*TINY, "--train-iters", "1", "--distributed-timeout-minutes",
                                                   "0.05"]))
    assert code == 2 and time.monotonic() - began < 120
    assert line == ("tessera train: error: rank(s) 1, 2 of 3 did not join within 0.05 min "
                    "(--distributed-timeout-minutes): a node not started, or started with another rendezvous endpoint")


def test_an_unreachable_endpoint_is_named():
    port = free_port()
    code, line = finish(start(1, 2, port, [*TINY, "--train-iters", "1", "--distributed-timeout-minutes", "0.02"]))
    assert code == 2
    assert line.startswith(f"tessera train: error: rank 1 cannot reach the rendezvous endpoint 127.0.0.1:{port} "
                           "(MASTER_ADDR:MASTER_PORT, from torchrun) within 0.02 min (--distributed-timeout-minutes)")


def test_ranks_with_other_flags_or_world_sizes_are_refused_on_every_rank():
    port = free_port()
    flags = [*TINY, "--train-iters", "1", "--distributed-timeout-minutes", "1"]
    ranks = [start(0, 2, port, flags), start(1, 2, port, [*flags, "--lr", "1e-3"])]
    results = [finish(p) for p in ranks]
    assert [code for code, _ in results] == [2, 2]
    expected = "rank 1 (host {0}) was started with other flags than rank 0 (host {0}): --lr: 0.001 here, 0.003 on rank 0"
    assert {line for _, line in results} == {"tessera train: error: " + expected.format(socket.gethostname())}

    port = free_port()
    ranks = [start(0, 2, port, flags), start(1, 3, port, flags)]
    results = [finish(p) for p in ranks]
    assert [code for code, _ in results] == [2, 2]
    assert all("was launched with world size 3 but rank 0" in line and "--nnodes x --nproc-per-node" in line
               for _, line in results), results


def test_a_hung_rank_becomes_an_error_naming_rank_and_iteration(tmp_path):
    """Rank 1 is stopped (SIGSTOP) mid-training; rank 0's next collective fails within the timeout."""
    port, log = free_port(), tmp_path / "rank1.jsonl"
    flags = [*TINY, "--train-iters", "100000", "--distributed-timeout-minutes", "0.05"]
    ranks = [start(0, 2, port, flags), start(1, 2, port, [*flags, "--log-json", str(log)])]
    try:
        while not log.exists() or not log.read_text():
            assert ranks[1].poll() is None, ranks[1].communicate()[1][-2000:]
            time.sleep(0.1)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        _, err = ranks[0].communicate(timeout=180)
    finally:
        ranks[1].kill()
        ranks[1].communicate()
    # exit code 2, not gloo's teardown aborting the process with its peer hung (SIGABRT, seen once in CI)
    assert ranks[0].returncode == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("tessera train: error: rank 0: a collective did not complete within "
                           "--distributed-timeout-minutes (0.05) at iteration "), line
    assert "another rank hung or died" in line


def _collective_on_a_mesh_group_times_out() -> bool:
    mesh = Mesh.build(ParallelConfig(tensor_model_parallel_size=2, distributed_timeout_minutes=0.05), "cpu")
    if mesh.rank == 1:
        time.sleep(8)   # never joins the all-reduce; the 30-minute default would hang the test
        return True
    try:
        dist.all_reduce(torch.ones(1), group=mesh.tp_group)
    except RuntimeError as exc:
        return "Timed out" in str(exc) or "timeout" in str(exc).lower()
    return False


def test_the_mesh_groups_follow_the_timeout_flag():
    assert run_distributed(_collective_on_a_mesh_group_times_out, 2, timeout=120) == [True, True]


# -- the dataset index cache on a filesystem that ranks and jobs share --------------------------

BUILD_LOGGING_TRAIN = """import os, sys
import tessera.data.gpt_dataset as gpt_dataset
from tessera.cli import run

build = gpt_dataset.build_indices
def logged(*args, **kwargs):
    with open(os.path.join(sys.argv[1], "builds.log"), "a") as log:
        log.write(f"job {sys.argv[2]} rank {os.environ['RANK']} documents {len(args[1])}\\n")
    return build(*args, **kwargs)
gpt_dataset.build_indices = logged
sys.exit(run(sys.argv[3:]))
"""


def corpus_and_flags(tmp_path) -> list[str]:
    """A small .bin/.idx corpus, a train script that logs each index build, and its flags."""
    prefix = str(tmp_path / "corpus")
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(200):
            writer.add_document(np.append(rng.integers(0, 90, rng.integers(5, 60)), 99))
    (tmp_path / "train.py").write_text(BUILD_LOGGING_TRAIN)
    return ["train", "--model", "tiny-llama", "--data-path", prefix, "--split", "90,10,0", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--lr", "1e-3", "--train-iters", "2", "--eval-interval", "2",
            "--eval-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "4", "--num-workers", "0"]


def builder(tmp_path, job: str, flags: list[str]) -> list[str]:
    return [sys.executable, str(tmp_path / "train.py"), str(tmp_path), job, *flags]


def assert_complete_cache(cache: Path) -> None:
    files = sorted(p.name for p in cache.iterdir())
    assert not [name for name in files if ".tmp" in name], files
    assert len(files) == 2 * 4, files   # two splits x (three index arrays + the description), once each
    for path in cache.glob("*.npy"):
        np.load(path)   # every entry complete


def test_the_index_cache_is_built_once_per_job_and_survives_a_concurrent_job(tmp_path):
    flags = [*corpus_and_flags(tmp_path), "--data-cache-path", str(tmp_path / "cache")]
    jobs = {"a": (4, free_port()), "b": (2, free_port())}   # b shares the cache directory, at the same time
    ranks = [start(r, size, port, [], command=builder(tmp_path, job, flags))
             for job, (size, port) in jobs.items() for r in range(size)]
    assert [finish(p)[0] for p in ranks] == [0] * 6, [p.stderr for p in ranks]
    builds = (tmp_path / "builds.log").read_text().splitlines()
    ranks_and_splits = [line.split(" rank ")[1] for line in builds]
    assert {line.split()[0] for line in ranks_and_splits} == {"0"}     # only rank 0 of a job builds
    assert len(set(builds)) == len(builds)   # each job builds each split at most once (none if the other job had)
    assert len(set(ranks_and_splits)) == 2   # train and valid, each built at least once
    assert_complete_cache(tmp_path / "cache")


def test_a_node_local_cache_is_built_once_per_node(tmp_path):
    """Two "nodes" of two ranks, each with its own --data-cache-path (node-local disk)."""
    flags, port = corpus_and_flags(tmp_path), free_port()
    ranks = [start(r, 4, port, [], local_rank=r % 2,
                   command=builder(tmp_path, "a", [*flags, "--data-cache-path", str(tmp_path / f"node{r // 2}")]))
             for r in range(4)]
    assert [finish(p)[0] for p in ranks] == [0] * 4, [p.stderr for p in ranks]
    builds = [line.split(" documents ")[0] for line in (tmp_path / "builds.log").read_text().splitlines()]
    assert sorted(builds) == ["job a rank 0"] * 2 + ["job a rank 2"] * 2   # each node's first rank, train and valid
    for node in (0, 1):
        assert_complete_cache(tmp_path / f"node{node}")

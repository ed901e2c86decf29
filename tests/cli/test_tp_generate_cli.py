"""`tessera generate` under torchrun with --tensor-model-parallel-size 2 (gloo, CPU) writes what one process writes.

Oracle: the same command in one process. Sampled (temperature, top-k, seeds from --seed)
so that the ranks agree only if they draw alike; a stop string makes the text layer abort
a request on every rank. The row-parallel all-reduce sums partial products in another
order: log-probs agree to 1e-5, the tokens exactly.
"""

import contextlib
import io
import json
import subprocess
import sys

import pytest
import torch

from tessera.cli import run
from tests.dist.launcher import run_distributed
from tests.inference.tiny_text_model import hf_dir  # noqa: F401 -- a fixture

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
PROMPTS = [{"id": 1, "prompt": "The quick brown"}, {"id": 2, "messages": [{"role": "user", "content": "héllo"}]},
           {"id": 3, "prompt": "def main():"}]


def _flags(hf_dir, source) -> list[str]:
    return ["generate", "--hf", str(hf_dir), "--input", str(source), "--output-format", "jsonl",
            "--max-new-tokens", "12", "--temperature", "0.9", "--top-k", "40", "--seed", "5", "--stop", "e"]


def test_torchrun_tp2_generate_writes_what_one_process_writes(hf_dir, tmp_path):
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in PROMPTS))
    assert run([*_flags(hf_dir, source), "--output", str(tmp_path / "one.jsonl")]) == 0
    expected = [json.loads(line) for line in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert {r["finish_reason"] for r in expected} >= {"stop"}   # the stop string ended one at least

    result = subprocess.run([*TORCHRUN, "-m", "tessera", *_flags(hf_dir, source), "--tensor-model-parallel-size",
                             "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # both ranks' standard output lands here: only rank 0 wrote
    actual = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(actual) == len(PROMPTS) and result.stderr.count("tokens/s") == 1
    for one, two in zip(expected, actual):
        assert (two["id"], two["token_ids"], two["completion"], two["finish_reason"]) == \
            (one["id"], one["token_ids"], one["completion"], one["finish_reason"])
        torch.testing.assert_close(torch.tensor(two["logprobs"]), torch.tensor(one["logprobs"]), rtol=0, atol=1e-5)


def test_a_tp_size_other_than_the_number_of_processes_is_named(hf_dir, capsys):
    with pytest.raises(SystemExit) as stopped:
        run(["generate", "--hf", str(hf_dir), "--prompt", "x", "--tensor-model-parallel-size", "2"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--tensor-model-parallel-size (2) must equal the number of processes (1" in err
    assert len(err.splitlines()) == 1


def _generate_at_tp3(directory: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            run(["generate", "--hf", directory, "--prompt", "x", "--tensor-model-parallel-size", "3"])
        except SystemExit as stopped:
            return stopped.code, err.getvalue()
    return 0, err.getvalue()


def test_heads_that_tp_does_not_divide_are_named(hf_dir):
    for code, err in run_distributed(_generate_at_tp3, 3, str(hf_dir)):   # 4 heads, 2 KV groups
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert "--num-attention-heads (4) must be divisible by --tensor-model-parallel-size (3)" in err

"""The command line as users launch it: torchrun with gloo on CPU, against one process."""

import json
import subprocess
import sys

FLAGS = ["--model", "tiny-llama", "--mock-data", "--lr", "3e-3", "--train-iters", "4", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--log-interval", "1", "--num-workers", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


def losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def run(args: list[str], log, extra: list[str] = ()) -> None:
    result = subprocess.run([*args, "-m", "tessera", "train", *FLAGS, *extra, "--log-json", str(log)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_torchrun_four_processes_matches_one(tmp_path):
    run([sys.executable], tmp_path / "single.jsonl")
    parallel = tmp_path / "parallel.jsonl"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"], parallel,
        ["--tensor-model-parallel-size", "2"])  # TP=2 x DP=2
    expected, actual = losses(tmp_path / "single.jsonl"), losses(parallel)
    assert len(actual) == 4
    assert all(abs(a - e) <= 1e-5 * abs(e) for a, e in zip(actual, expected)), (actual, expected)

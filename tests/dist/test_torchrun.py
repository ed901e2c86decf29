"""The command line as users launch it: torchrun with gloo on CPU, one node or two, against one process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ports import free_port

FLAGS = ["--model", "tiny-llama", "--mock-data", "--lr", "3e-3", "--train-iters", "4", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--log-interval", "1", "--num-workers", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def losses(log) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()]


def command(launcher: list[str], log, extra: list[str] = ()) -> list[str]:
    return [*launcher, "-m", "tessera", "train", *FLAGS, *extra, "--log-json", str(log)]


def run(launcher: list[str], log, extra: list[str] = ()) -> None:
    result = subprocess.run(command(launcher, log, extra), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    log = tmp_path_factory.mktemp("single") / "single.jsonl"
    run([sys.executable], log)
    return losses(log)


def assert_equal_losses(actual, expected):
    assert len(actual) == 4
    assert all(abs(a - e) <= 1e-5 * abs(e) for a, e in zip(actual, expected)), (actual, expected)


def test_torchrun_four_processes_matches_one(tmp_path, single_process_losses):
    parallel = tmp_path / "parallel.jsonl"
    run([*TORCHRUN, "--standalone", "--nproc-per-node", "4"], parallel, ["--tensor-model-parallel-size", "2"])
    assert_equal_losses(losses(parallel), single_process_losses)  # TP=2 x DP=2


def test_two_torchrun_nodes_with_c10d_rendezvous_match_one_process(tmp_path, single_process_losses):
    """Two "nodes" of two processes on localhost, joined by torchrun's c10d rendezvous, as a
    multi-node job is launched (one torchrun per node, the same endpoint): TP=2 x DP=2."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        command([*TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", endpoint, "--rdzv-id", "tessera-test"], tmp_path / f"node{n}.jsonl",
                ["--tensor-model-parallel-size", "2"]),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [e[-3000:] for e in errors]
    # Metrics are written by the last rank, on whichever node the rendezvous put it.
    logs = [path for path in tmp_path.glob("node*.jsonl") if path.read_text()]
    assert len(logs) == 1
    assert_equal_losses(losses(logs[0]), single_process_losses)


def test_an_error_found_after_the_ranks_start_is_printed_once_without_a_traceback(tmp_path):
    """Both ranks find that 3 key/value groups cannot be split over TP=2 (in the model, after the
    process group exists): one line from one rank, exit code 2, no rank's traceback."""
    import tessera

    result = subprocess.run(
        command([*TORCHRUN, "--standalone", "--nproc-per-node", "2"], tmp_path / "log.jsonl",
                ["--tensor-model-parallel-size", "2", "--hidden-size", "96", "--num-attention-heads", "6",
                 "--num-query-groups", "3"]), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("tessera train: error:") == 1, result.stderr[-3000:]
    assert "--num-query-groups (3)" in result.stderr
    package = str(Path(tessera.__file__).parent)
    assert not [line for line in result.stderr.splitlines() if package in line], result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr    # torchrun's own summary of the failed ranks

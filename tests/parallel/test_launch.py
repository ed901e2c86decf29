"""Who a process is in its job: torchrun's variables, SLURM's, and their errors."""

import os
import subprocess
import sys

import pytest

from tessera.config import ModelConfig, RunConfig, TrainConfig
from tessera.models.presets import preset_values
from tessera.parallel.launch import LaunchError, config_fingerprint, first_host, resolve_environment
from tessera.training.stragglers import straggler_line
from tests.ports import free_port


def test_torchrun_variables_win_over_slurm():
    env = resolve_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
                               "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == \
        (3, 4, 1, "n1", 1234, "torchrun")


def test_no_variables_is_one_process():
    env = resolve_environment({})
    assert (env.rank, env.world_size) == (0, 1)


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[003-005,9],login1", "gpu003"), ("a1,b[2-3]", "a1"), ("node7", "node7"),
    ("rack[1-2]-n[07-09]", "rack1-n07"), ("h[10,2]", "h10"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, first):
    assert first_host(nodelist) == first


SHOW_VARIABLES = """import os, pathlib, sys
values = [os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")]
pathlib.Path(sys.argv[1], "rank" + values[0]).write_text(" ".join(values))
"""


def test_slurm_gives_the_ranks_torchrun_gives(tmp_path):
    """Two nodes x 2 processes: torchrun's assignment (static rendezvous, so node rank is
    --node-rank) against the one derived from SLURM's variables for the same layout."""
    script = tmp_path / "show.py"
    script.write_text(SHOW_VARIABLES)
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), str(script), str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in (0, 1)]
    assert [node.wait(timeout=120) for node in nodes] == [0, 0]
    torchrun = sorted(tuple(map(int, path.read_text().split())) for path in tmp_path.glob("rank*"))
    slurm = []
    for procid in range(4):   # SLURM's block distribution: tasks 0-1 on the first node, 2-3 on the second
        env = resolve_environment({"SLURM_PROCID": str(procid), "SLURM_NTASKS": "4", "SLURM_LOCALID": str(procid % 2),
                                   "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_ID": "77"})
        assert (env.master_addr, env.source) == ("node01", "SLURM")
        slurm.append((env.rank, env.local_rank, env.world_size))
    assert torchrun == sorted(slurm) and len(torchrun) == 4


def test_two_slurm_jobs_get_different_ports():
    ports = {resolve_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
                                  "SLURM_JOB_ID": job}).master_port for job in ("1001", "1002")}
    assert len(ports) == 2


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK 4 is outside [0, WORLD_SIZE 4)"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK must be an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be >= 1"),
    ({"SLURM_PROCID": "8", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n1"}, "SLURM_PROCID 8 is outside"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "neither SLURM_JOB_NODELIST nor MASTER_ADDR"),
])
def test_bad_launch_variables_are_named(environ, message):
    with pytest.raises(LaunchError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        resolve_environment(environ)


def test_rank_out_of_range_fails_before_training():
    result = subprocess.run([sys.executable, "-m", "tessera", "train", "--model", "tiny-llama", "--mock-data",
                             "--lr", "1e-3", "--train-iters", "1"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "RANK": "2", "WORLD_SIZE": "2"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tessera train: error: RANK 2 is outside [0, WORLD_SIZE 2): a node rank or --nnodes that does not "
        "match the other nodes?")


def test_the_fingerprint_skips_per_node_paths_only():
    def fingerprint(**train):
        return config_fingerprint(RunConfig(model=ModelConfig(**preset_values("tiny-llama")), train=TrainConfig(train_iters=1, **train)))

    assert fingerprint(log_json="a.jsonl", tensorboard_dir="tb0") == fingerprint(log_json="b.jsonl")
    assert fingerprint(micro_batch_size=2) != fingerprint(micro_batch_size=4)


def test_straggler_line_names_slowest_and_fastest():
    line = straggler_line([0.010, 0.030, 0.020, 0.005], ["a", "a", "b", "b"], count=2)
    assert line == (" straggler: forward-backward ms/iteration, slowest rank 1 (a) 30.0, rank 2 (b) 20.0 | "
                    "fastest rank 3 (b) 5.0, rank 0 (a) 10.0 | max/min 6.00")

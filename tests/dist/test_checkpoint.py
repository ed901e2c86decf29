"""Checkpoints under parallel layouts (gloo, CPU): exact resume in the same layout, and
resharding: save under one layout, load under another, continue with the same losses; what
saving and loading print, once per job.

Exact resume is bitwise: the resumed run repeats the uninterrupted run's arithmetic.
After resharding the reduction order changes, so losses are compared with single-process
training at the equivalence tolerance (rtol 1e-5, tests/dist/equivalence.py).
"""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist

from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.dist.equivalence import BASE, STEPS, late_parameter_gathers
from tests.dist.launcher import run_distributed

STOP = 2  # the interrupted run saves here; the resumed one goes on to STEPS


def _losses(flags: list[str]) -> list[float]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    config, _ = parse_run_config(BASE + flags, "test", world_size=world)
    return [r.loss for r in Trainer(config).train()]


def interrupted_and_uninterrupted(flags: list[str], directory: str) -> tuple[list[float], list[float]]:
    """Run on every rank: (uninterrupted losses, losses stopped at STOP and resumed)."""
    expected = _losses(flags)
    before = _losses(flags + ["--save", directory, "--exit-interval", str(STOP)])
    after = _losses(flags + ["--load", directory])
    return expected, before + after


def save_at_stop(flags: list[str], directory: str) -> list[float]:
    return _losses(flags + ["--save", directory, "--exit-interval", str(STOP)])


def resume(flags: list[str], directory: str) -> list[float]:
    return _losses(flags + ["--load", directory])


@pytest.fixture(scope="module")
def reference():
    return _losses([])


EXACT = {
    "TP=2": ["--tensor-model-parallel-size", "2"],
    "DP=2 distributed optimizer": ["--use-distributed-optimizer"],
    # bf16 weights beside sharded fp32 masters: the masters, not the bf16 copy, must be saved.
    "DP=2 distributed optimizer, bf16": ["--use-distributed-optimizer", "--bf16"],
    "FSDP2 DP=2": ["--use-torch-fsdp2"],
    "PP=2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.mark.parametrize("layout", EXACT)
def test_exact_resume(layout, tmp_path):
    expected, resumed = run_distributed(interrupted_and_uninterrupted, 2, EXACT[layout], str(tmp_path))[0]
    assert len(expected) == STEPS and resumed == expected


def _interrupted_with_late_gathers(flags: list[str], directory: str) -> tuple[list[float], list[float]]:
    with late_parameter_gathers():
        return interrupted_and_uninterrupted(flags, directory)


def test_saving_waits_for_parameter_gathers(tmp_path):
    # The save at STOP comes right after a step whose gathers are still in flight.
    flags = ["--use-distributed-optimizer", "--overlap-param-gather", "--ddp-bucket-size", "20000"]
    expected, resumed = run_distributed(_interrupted_with_late_gathers, 2, flags, str(tmp_path))[0]
    assert len(expected) == STEPS and resumed == expected


# (saved under, its world size) -> (loaded under, its world size)
RESHARD = {
    "TP=2 -> TP=1": ((["--tensor-model-parallel-size", "2"], 2), ([], 1)),
    "dist-opt DP=4 -> dist-opt DP=2": ((["--use-distributed-optimizer"], 4), (["--use-distributed-optimizer"], 2)),
    "FSDP2 DP=2 -> TP=1": ((["--use-torch-fsdp2"], 2), ([], 1)),
    "TP=1 -> PP=2": (([], 1), (["--pipeline-model-parallel-size", "2"], 2)),
    "TP=2 x PP=2 -> PP=2 dist-opt DP=2": ((["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4),
                                          (["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], 4)),
}


def _on(world: int, fn, flags, directory):
    return fn(flags, directory) if world == 1 else run_distributed(fn, world, flags, directory)[-1]


@pytest.mark.parametrize("change", RESHARD)
def test_resharding_continues_with_the_same_losses(change, tmp_path, reference):
    (save_flags, save_world), (load_flags, load_world) = RESHARD[change]
    before = _on(save_world, save_at_stop, save_flags, str(tmp_path))
    after = _on(load_world, resume, load_flags, str(tmp_path))
    assert len(before) == STOP and len(after) == STEPS - STOP
    torch.testing.assert_close(before + after, reference, rtol=1e-5, atol=0)


def _printed_by_a_first_launch(directory: str) -> str:
    """Run on every rank: what a job's first launch with `--save DIR --load DIR` prints."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        _losses(["--save", directory, "--load", directory, "--train-iters", "2", "--save-interval", "1",
                 "--tensor-model-parallel-size", "2"])
    return printed.getvalue()


def test_saving_and_a_fresh_start_are_said_once_by_rank_0(tmp_path):
    printed = run_distributed(_printed_by_a_first_launch, 2, str(tmp_path / "ckpt"))
    assert printed[0].count("starting from scratch") == 1 and printed[0].count("saved checkpoint at iteration") == 2
    assert "starting from scratch" not in printed[1] and "saved checkpoint" not in printed[1]

"""FP8 delayed scaling across a checkpoint: the amax histories and scales are saved apart
from the model's weights and restored on resume, so that the losses after a resume are the
uninterrupted run's; checkpoints without them (bf16 runs) resume with fresh histories.

torch._scaled_mm runs on CPU (tests/training/test_fp8.py checks its GEMMs there): the trainer's
device check, which wants FP8 tensor cores, is switched off here (tests.conftest.fp8_on_cpu).
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import fp8_on_cpu, run_config
from tessera.training.checkpoint import iteration_dir
from tessera.training.trainer import Trainer

FLAGS = ["--train-iters", "4", "--seq-length", "32", "--bf16"]
# A history longer than one step, with its max as the amax: a fresh history gives other scales for 3 steps.
DELAYED = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "3",
           "--fp8-amax-compute-algo", "max"]


@pytest.fixture(autouse=True)
def on_cpu():
    with fp8_on_cpu():
        yield


def _trainer(*flags):
    return Trainer(run_config(*FLAGS, *flags))


def _scaling(trainer):
    return [(layer.amax_history.clone(), layer.scales.clone()) for layer in trainer.fp8_layers]


def _saved_keys(directory):
    return set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)


def test_delayed_scaling_with_fp8_param_gather_resumes_with_the_uninterrupted_losses(tmp_path):
    # The resumed E4M3 weights are cast with the restored scales, not fresh ones.
    flags = (*DELAYED, "--use-distributed-optimizer", "--fp8-param-gather")
    expected = [r.loss for r in _trainer(*flags).train()]
    before = [r.loss for r in _trainer(*flags, "--save", str(tmp_path), "--exit-interval", "2").train()]
    assert before + [r.loss for r in _trainer(*flags, "--load", str(tmp_path)).train()] == expected


def test_delayed_scaling_resumes_with_the_uninterrupted_losses(tmp_path):
    expected = [r.loss for r in _trainer(*DELAYED).train()]
    first = _trainer(*DELAYED, "--save", str(tmp_path), "--exit-interval", "2")
    before = [r.loss for r in first.train()]
    saved = _scaling(first)
    keys = _saved_keys(iteration_dir(tmp_path, 2))
    assert {key for key in keys if key.startswith("model.")} == {f"model.{k}" for k in first.model.state_dict()}
    assert sorted(key for key in keys if key.startswith("fp8.")) == sorted(
        f"fp8.layers.{i}.{linear}.fp8.{kind}" for i in range(2)
        for linear in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2") for kind in ("amax_history", "scales"))

    resumed = _trainer(*DELAYED, "--load", str(tmp_path))
    for (history, scales), (saved_history, saved_scales) in zip(_scaling(resumed), saved, strict=True):
        assert torch.equal(history, saved_history) and torch.equal(scales, saved_scales)
    assert before + [r.loss for r in resumed.train()] == expected

    # Another history length keeps the newest steps; a run without FP8 ignores the FP8 state.
    shorter = _trainer(*DELAYED, "--fp8-amax-history-len", "1", "--load", str(tmp_path))
    assert all(torch.equal(h, s[:, :1]) for (h, _), (s, _) in zip(_scaling(shorter), saved))
    assert _trainer("--load", str(tmp_path)).iteration == 2


def test_a_bf16_checkpoint_resumes_delayed_scaling_fresh_with_a_warning(tmp_path, capsys):
    _trainer("--save", str(tmp_path), "--train-iters", "1").train()
    assert not any(key.startswith("fp8.") for key in _saved_keys(iteration_dir(tmp_path, 1)))
    capsys.readouterr()
    resumed = _trainer(*DELAYED, "--load", str(tmp_path))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "FP8" in line]
    assert len(warnings) == 1 and "no FP8 delayed-scaling state for 8 layers" in warnings[0]
    assert resumed.iteration == 1
    for layer in resumed.fp8_layers:
        assert not layer.calibrated and not layer.amax_history.any() and torch.equal(layer.scales, torch.ones(3))
    resumed.train()   # its first step calibrates from its own amaxes, as a fresh run's does
    assert all(layer.calibrated and layer.amax_history[:, 0].all() for layer in resumed.fp8_layers)

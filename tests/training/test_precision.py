"""fp16 loss scaling: overflowing iterations are skipped and counted, the scale adapts."""

import json

import torch

from tessera.config import TrainConfig
from tessera.training.precision import LossScaler
from tests.conftest import run_config
from tessera.training.trainer import Trainer


def test_dynamic_scaler_hysteresis_and_growth():
    scaler = LossScaler(TrainConfig(train_iters=1, fp16=True, initial_loss_scale=1024.0, hysteresis=2,
                                    loss_scale_window=3, min_loss_scale=256.0))
    scaler.update(True)
    assert scaler.scale == 1024.0            # first overflow is absorbed by hysteresis
    scaler.update(True)
    assert scaler.scale == 512.0
    scaler.update(True)
    assert scaler.scale == 256.0
    scaler.update(True)
    assert scaler.scale == 256.0             # floor
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 512.0             # window of clean iterations doubles it
    state = scaler.state_dict()
    other = LossScaler(TrainConfig(train_iters=1, fp16=True))
    other.load_state_dict(state)
    assert other.scale == 512.0


def test_static_and_unscaled():
    assert LossScaler(TrainConfig(train_iters=1, fp16=True, loss_scale=8.0)).scale == 8.0
    assert not LossScaler(TrainConfig(train_iters=1, fp16=True, loss_scale=8.0)).dynamic
    assert LossScaler(TrainConfig(train_iters=1)).scale == 1.0


def test_overflowing_iterations_are_skipped_without_touching_parameters():
    # A loss scale of 2^30 overflows fp16 gradients until hysteresis and halving bring it down.
    config = run_config("--fp16", "--initial-loss-scale", str(2.0**30), "--hysteresis", "1",
                        "--train-iters", "30", "--lr", "1e-2")
    trainer = Trainer(config)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    first = trainer.train_step().resolve()
    assert first.skipped
    for a, b in zip(before, trainer.model.parameters()):
        assert torch.equal(a, b)             # the overflowing update was not applied
    assert trainer.loss_scaler.scale == 2.0**29
    history = [first] + trainer.train()
    skipped = sum(r.skipped for r in history)
    assert 0 < skipped < len(history)        # it recovered and trained
    assert trainer.skipped_iterations == skipped - 1  # counted (the first step ran outside train())
    assert not history[-1].skipped


def test_skipped_iterations_are_logged_as_skipped_not_as_nan(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    config = run_config("--fp16", "--initial-loss-scale", str(2.0**30), "--hysteresis", "1", "--train-iters", "2",
                        "--log-interval", "1", "--log-json", str(log))
    Trainer(config).train()
    first = next(line for line in capsys.readouterr().out.splitlines() if "iteration " in line)   # it overflowed
    assert "lm loss: skipped" in first and "grad norm: skipped" in first and "NAN" not in first.upper().replace("NAN ITERATIONS", "")
    record = json.loads(log.read_text().splitlines()[0])
    assert record["loss"] is None and record["grad_norm"] is None and record["skipped_iterations"] == 1

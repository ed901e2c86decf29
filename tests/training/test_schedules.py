"""Learning-rate schedules against values computed by hand from their definitions."""

import math

import pytest

from tessera.config import OptimConfig, TrainConfig
from tessera.training.schedules import LRSchedule


def schedule(train_iters=100, **kwargs):
    return LRSchedule(OptimConfig(**{"lr": 1.0, "min_lr": 0.1, **kwargs}), TrainConfig(train_iters=train_iters))


def test_linear_warmup_from_init():
    lr = schedule(lr_decay_style="constant", lr_warmup_iters=10, lr_warmup_init=0.2)
    assert lr(0) == pytest.approx(0.2)
    assert lr(5) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr(10) == pytest.approx(1.0)
    assert lr(50) == pytest.approx(1.0)


def test_warmup_fraction_of_decay_iters():
    lr = schedule(lr_decay_style="constant", lr_warmup_fraction=0.25, lr_decay_iters=40)
    assert lr.warmup_iters == 10 and lr(5) == pytest.approx(0.5)


def test_linear_decay():
    lr = schedule(lr_decay_style="linear", lr_warmup_iters=10)
    assert lr(10) == pytest.approx(1.0)
    assert lr(55) == pytest.approx(0.1 + 0.9 * (1 - 45 / 90))
    assert lr(100) == pytest.approx(0.1)
    assert lr(150) == pytest.approx(0.1)


def test_cosine_decay():
    lr = schedule(lr_decay_style="cosine", lr_decay_iters=50)
    assert lr(0) == pytest.approx(1.0)
    assert lr(25) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr(40) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.8)))
    assert lr(60) == pytest.approx(0.1)


def test_inverse_square_root():
    lr = schedule(lr_decay_style="inverse-square-root", lr_warmup_iters=4, min_lr=0.0)
    assert lr(2) == pytest.approx(0.5)
    assert lr(16) == pytest.approx(1.0 * 2 / 4)
    assert lr(64) == pytest.approx(1.0 * 2 / 8)


@pytest.mark.parametrize("style, at_half", [
    ("linear", 0.5), ("cosine", 0.5), ("exponential", 2 * 0.5**0.5 - 1), ("minus_sqrt", 1 - 0.5**0.5),
])
def test_wsd(style, at_half):
    lr = schedule(lr_decay_style="WSD", lr_warmup_iters=10, lr_wsd_decay_iters=20, lr_wsd_decay_style=style)
    assert lr(5) == pytest.approx(0.5)
    assert lr(50) == pytest.approx(1.0) and lr(80) == pytest.approx(1.0)   # stable phase
    assert lr(90) == pytest.approx(0.1 + 0.9 * at_half)
    assert lr(100) == pytest.approx(0.1)


def test_sample_based_schedule_is_megatrons_over_samples():
    """--train-samples: Megatron-LM's scheduler steps by the global batch's samples; at iteration i
    it has seen i x 8 samples (warmup 20 samples, cosine decay over 100)."""
    optim = OptimConfig(lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_warmup_samples=20, lr_decay_samples=100)
    lr = LRSchedule(optim, TrainConfig(train_iters=12, train_samples=100, global_batch_size=8))
    assert lr(2) == pytest.approx(16 / 20)
    assert lr(3) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * (24 - 20) / 80) + 1))
    assert lr(13) == pytest.approx(0.1)   # past 100 samples


def test_decoupled_rate_follows_the_same_schedule_between_its_own_bounds():
    optim = OptimConfig(lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_warmup_iters=10, decoupled_lr=3.0)
    lr = LRSchedule(optim, TrainConfig(train_iters=100))
    assert lr.decoupled(5) == pytest.approx(1.5)                # warmup towards 3.0
    assert lr.decoupled(55) == pytest.approx(0.1 + 2.9 * 0.5)   # halfway down to --min-lr (its default floor)
    optim.decoupled_min_lr = 0.5
    assert LRSchedule(optim, TrainConfig(train_iters=100)).decoupled(100) == pytest.approx(0.5)
    assert schedule().decoupled(5) is None

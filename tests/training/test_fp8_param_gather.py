"""--fp8-param-gather in one process: the layers read the E4M3 weights the optimizer cast after
its step instead of casting their own, bit for bit the same training for every recipe (without
gradient clipping: the FP8 weights' buffer of their own sums the gradient norm in another
order, which moves a clipped update by an ulp). Data parallelism: tests/dist/test_fp8_param_gather.py.

torch._scaled_mm runs on the CPU (tests/training/test_fp8.py); the trainer's check for FP8 tensor
cores is switched off (tests.conftest.fp8_on_cpu).
"""

import pytest
import torch

from tessera.training.trainer import Trainer
from tests.conftest import fp8_on_cpu, run_config

RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "2"],
    "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--hidden-size", "128",
                  "--ffn-hidden-size", "256", "--seq-length", "128"],
}


@pytest.fixture(autouse=True)
def on_cpu():
    with fp8_on_cpu():
        yield


def _train(flags):
    trainer = Trainer(run_config("--model", "tiny-llama", "--global-batch-size", "2", "--bf16", "--train-iters", "4",
                                 "--use-distributed-optimizer", "--clip-grad", "0", *flags))
    losses = [r.loss for r in trainer.train()]
    return losses, [p.detach().clone() for p in trainer.model.parameters()], trainer


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gathered_fp8_weights_train_exactly_as_casting_them_in_the_layers(recipe):
    losses, weights, _ = _train(RECIPES[recipe])
    gathered_losses, gathered_weights, trainer = _train(RECIPES[recipe] + ["--fp8-param-gather"])
    assert all(layer.weight_fp8 is not None for layer in trainer.fp8_layers)   # the layers read the copy
    assert gathered_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(gathered_weights, weights, strict=True))

"""A cold start compiles each kind of block once: Dynamo traces one graph that every identical
block reuses (its guards pass for all of them), with FP8 layers too. A block that failed its
guards would be traced and compiled again for each layer, multiplying the first step's time
by the layer count."""

import pytest
import torch
from torch._dynamo.utils import counters

from tessera.config import ModelConfig
from tessera.kernels.fp8 import Fp8Recipe
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import preset_values
from tessera.training import fp8


@pytest.mark.parametrize("recipe", [None, "tensorwise", "delayed"])
def test_identical_blocks_share_one_graph(recipe):
    torch._dynamo.reset()
    counters.clear()
    model = GPTModel(ModelConfig(**{**preset_values("tiny-llama"), "num_layers": 4}))
    initialize_parameters(model, seed=4)
    if recipe is not None:
        fp8.apply_fp8(model.layers.items(), Fp8Recipe(recipe=recipe), set(), 64)
    for layer in model.layers:
        layer.compile(backend="eager")   # Dynamo's tracing and guards, without Inductor's codegen
    tokens = torch.randint(0, 200, (2, 32))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(tokens, labels=tokens).mean().backward()
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()

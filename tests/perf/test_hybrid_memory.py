"""The planner's memory model on hybrid stacks: each layer priced by its symbol, and what a Mamba-2 or
Gated DeltaNet layer saves for backward against autograd (saved-tensor hooks, tests/perf/saved_tensors.py)."""

import functools

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models.presets import preset_values
from tessera.perf.flops import count_parameters
from tessera.perf.layout import Layout
from tessera.perf.memory import estimate_memory, layer_activation_bytes
from tests.perf.saved_tensors import bytes_saved_for_backward

# 200 tokens: two SSD chunks (128) and four delta-rule chunks (64), the second of each padded. Heads,
# head and state widths all differ, so that no two terms of the model can stand in for each other.
B, S, H = 2, 200, 320
MIXER_FLAGS = ["--mamba-head-dim", "32", "--mamba-state-dim", "48", "--mamba-num-groups", "2",
               "--linear-num-key-heads", "2", "--linear-num-value-heads", "6", "--linear-key-head-dim", "48",
               "--linear-value-head-dim", "40"]


def saved_hybrid_layer_bytes(pattern: str, *, compiled: bool, tp: int = 1):
    """(bytes the first layer of a `pattern` stack saves for backward at B x S x H, its ModelConfig); with
    `tp` > 1 this rank's share under sequence parallelism, under a process group of `tp` ranks.

    LayerNorm: eager RMSNorm on the CPU keeps its output too, which the model leaves out as
    tests/perf/test_memory.py does. Left out of the count: storages under 12 bytes a token, the norms'
    per-token statistics (up to two groups each)."""
    from tessera.cli.args import parse_run_config
    from tessera.config import ParallelConfig
    from tessera.models.gpt import GPTModel
    from tessera.parallel.mesh import Mesh

    config, _ = parse_run_config(["--model", "tiny-hybrid", "--hybrid-layer-pattern", pattern,
                                  "--hidden-size", str(H), "--ffn-hidden-size", str(4 * H), "--num-attention-heads",
                                  "4", "--num-query-groups", "2", "--normalization", "LayerNorm",
                                  "--seq-length", str(S), *MIXER_FLAGS, "--lr", "1e-3", "--train-iters", "1",
                                  "--mock-data"], "test")
    tp_group = Mesh.build(ParallelConfig(tensor_model_parallel_size=tp), "cpu").tp_group if tp > 1 else None
    block = GPTModel(config.model, tp_group=tp_group, sequence_parallel=tp > 1).layers[0]
    if compiled:
        torch._dynamo.reset()   # as saved_tensors.saved_block_bytes: a fresh compile, not a cached eager fallback
        block.compile()
    x = torch.randn(B, S // tp, H, requires_grad=True)
    return bytes_saved_for_backward(block, x, None, smaller_left_out=12 * B * S), config.model


def _tessera(compiled: bool, **extra) -> Layout:
    return Layout(micro_batch_size=B, compiled=compiled, framework="tessera", **extra)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("symbol", ["M", "G"])
def test_mixer_layer_activations_are_what_autograd_saves(symbol, compiled):
    saved, model = saved_hybrid_layer_bytes(symbol, compiled=compiled)
    predicted = layer_activation_bytes(model, _tessera(compiled), S, symbol=symbol)
    assert saved == pytest.approx(predicted, rel=0.005)


def test_attention_and_mlp_layers_save_only_their_own_part():
    """A `*` layer has no MLP and a `-` layer no attention: each saves one norm input and its own tensors."""
    for symbol in "*-":
        saved, model = saved_hybrid_layer_bytes(symbol, compiled=False)
        assert saved == pytest.approx(layer_activation_bytes(model, _tessera(False), S, symbol=symbol), rel=0.005)


def test_tensor_parallel_mixers_save_their_heads_and_the_gathered_input():
    """On each of two TP ranks under SP (gloo): the norm input is a sequence shard, in_proj keeps its
    all-gathered input, and everything inside the mixer is this rank's heads and groups."""
    from tests.dist.launcher import run_distributed

    for symbol in "MG":
        saved = run_distributed(functools.partial(saved_hybrid_layer_bytes, symbol, compiled=False, tp=2), 2)
        model = saved[0][1]
        predicted = layer_activation_bytes(model, _tessera(False, tp=2, sequence_parallel=True), S, symbol=symbol)
        for rank_saved, _ in saved:
            assert rank_saved == pytest.approx(predicted, rel=0.005)


def nemotron_h() -> ModelConfig:
    return ModelConfig(**preset_values("nemotron-h-8b"))


def test_each_hybrid_layer_is_priced_by_its_symbol():
    """Nemotron-H 8B's 52 layers (24 M, 4 *, 24 -) on one GPU: the activations are the sum of each
    layer's kind, a `*` and a `-` layer together are one transformer block (Megatron's, eager: a norm
    input each), and weights, gradients and optimizer state are 18 bytes a parameter."""
    model, layout = ModelConfig(**preset_values("nemotron-h-8b")), Layout(micro_batch_size=1)
    kinds = {symbol: layer_activation_bytes(model, layout, 8192, symbol=symbol) for symbol in "M*-"}
    memory = estimate_memory(model, layout, 1, 8192)
    assert memory.activations == pytest.approx(sum(kinds[symbol] for symbol in model.hybrid_layer_pattern))
    assert kinds["*"] + kinds["-"] == pytest.approx(layer_activation_bytes(model, layout, 8192))
    assert memory.weights + memory.gradients + memory.optimizer == pytest.approx(18 * count_parameters(model).total)

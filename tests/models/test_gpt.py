"""GPTModel: shapes, parameter counts per preset family, recompute, initialisation."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.parallel.tensor import ShardSpec
from tessera.perf.flops import count_parameters


def numel_on_meta(config: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(config).parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_formula_matches_module(name):
    config = ModelConfig(**PRESETS[name])
    assert numel_on_meta(config) == count_parameters(config).total


@pytest.mark.parametrize("name, published", [
    ("gpt3-175b", 174.6e9),   # GPT-3 paper, vocab 50257
    ("llama3-8b", 8.03e9),    # Meta's model card
    ("llama3-70b", 70.6e9),
    ("llama2-7b", 6.74e9),
    ("qwen2.5-7b", 7.62e9),
    ("mistral-7b", 7.25e9),
])
def test_parameter_count_matches_published(name, published):
    config = ModelConfig(**PRESETS[name])
    total = count_parameters(config, vocab_size=config.vocab_size).total
    assert abs(total - published) / published < 0.005


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
def test_shapes_and_loss(name):
    config = ModelConfig(**PRESETS[name])
    model = GPTModel(config).eval()  # no dropout: the two calls must agree
    initialize_parameters(model, seed=0)
    tokens = torch.randint(0, config.vocab_size, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, config.padded_vocab_size())
    losses = model(tokens, labels=tokens)
    assert losses.shape == (3, 16) and losses.dtype == torch.float32
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none")
    torch.testing.assert_close(losses.flatten(), expected)


def test_causal():
    """Changing a later token never changes the logits of earlier positions."""
    config = ModelConfig(**PRESETS["tiny-llama"])
    model = GPTModel(config).eval()
    initialize_parameters(model, seed=0)
    tokens = torch.randint(0, config.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 7] = (changed[0, 7] + 1) % config.vocab_size
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_initialisation_depends_only_on_seed_and_name():
    config = ModelConfig(**PRESETS["tiny-gpt"])
    first, second, other = GPTModel(config), GPTModel(config), GPTModel(config)
    torch.manual_seed(123)  # the global RNG must not matter
    initialize_parameters(first, seed=7)
    torch.manual_seed(456)
    initialize_parameters(second, seed=7)
    initialize_parameters(other, seed=8)
    for (name, a), b, c in zip(first.named_parameters(), second.parameters(), other.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        if "norm" not in name and "bias" not in name:
            assert not torch.equal(a, c), name
    std = config.init_method_std
    assert abs(first.layers[0].mlp.fc1.weight.std().item() - std) < 0.1 * std
    out_std = first.layers[0].mlp.fc2.weight.std().item()
    assert abs(out_std - std / (2 * config.num_layers) ** 0.5) < 0.1 * out_std


def test_shard_spec_cuts_every_fused_block():
    """A rank's shard of a fused [q; k; v] weight is its piece of each block, in order."""
    full = torch.arange(12.0).view(12, 1)  # q = rows 0-5, k = 6-8, v = 9-11 ... with q:6, k:3, v:3
    spec = ShardSpec((12, 1), dim=0, segments=(6, 3, 3), rank=1, size=3)
    assert spec.shard(full).flatten().tolist() == [2, 3, 7, 10]
    assert ShardSpec((12, 1)).shard(full) is full


@pytest.mark.parametrize("recompute", [
    Recompute("selective"),
    Recompute("full", "uniform", 1),
    Recompute("full", "uniform", 2),
    Recompute("full", "block", 1),
])
def test_recompute_gives_the_same_gradients(recompute):
    config = ModelConfig(**{**PRESETS["tiny-llama"], "hidden_dropout": 0.0, "attention_dropout": 0.0})
    reference, recomputed = GPTModel(config), GPTModel(config, recompute=recompute)
    initialize_parameters(reference, seed=3)
    initialize_parameters(recomputed, seed=3)
    tokens = torch.randint(0, config.vocab_size, (2, 32))
    for model in (reference, recomputed):
        model(tokens, labels=tokens).mean().backward()
    for (name, a), b in zip(reference.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


def test_recompute_saves_activation_memory():
    """Full recompute keeps fewer tensors alive for backward than no recompute."""
    config = ModelConfig(**{**PRESETS["tiny-llama"], "num_layers": 4})
    tokens = torch.randint(0, config.vocab_size, (2, 64))
    saved = {}
    for label, recompute in [("none", Recompute()), ("full", Recompute("full", "uniform", 4))]:
        model = GPTModel(config, recompute=recompute)
        initialize_parameters(model, seed=0)
        count = [0]

        def pack(t, count=count):
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, labels=tokens).mean()
        saved[label] = count[0]
    assert saved["full"] < 0.5 * saved["none"]

"""DropoutRNG: a per-rank dropout stream that leaves the default one alone and replays under recompute."""

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ModelConfig
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.parallel.random import DropoutRNG, dropout

ONES = torch.ones(32, 32)


def test_fork_leaves_the_default_stream_untouched():
    torch.manual_seed(0)
    expected = [torch.rand(4), torch.rand(4)]
    torch.manual_seed(0)
    rng = DropoutRNG(0)
    first = torch.rand(4)
    with rng.fork(ONES.device):
        torch.rand(100)
    assert torch.equal(first, expected[0]) and torch.equal(torch.rand(4), expected[1])


def test_fork_continues_one_stream_seeded_by_seed_and_rank():
    rng, same, other_rank = DropoutRNG(5, tp_rank=0), DropoutRNG(5, tp_rank=0), DropoutRNG(5, tp_rank=1)
    draws = []
    for generator in (rng, rng, same, other_rank):
        with generator.fork(ONES.device):
            draws.append(torch.rand(8))
    assert not torch.equal(draws[0], draws[1])  # the stream advances
    assert torch.equal(draws[0], draws[2])      # same seed and rank: same masks
    assert not torch.equal(draws[0], draws[3])  # another TP rank: other masks


def test_state_dict_resumes_the_stream():
    rng = DropoutRNG(3)
    with rng.fork(ONES.device):
        torch.rand(8)
    restored = DropoutRNG(99)
    restored.load_state_dict(rng.state_dict())
    with rng.fork(ONES.device):
        expected = torch.rand(8)
    with restored.fork(ONES.device):
        assert torch.equal(torch.rand(8), expected)


def test_dropout_draws_from_the_given_stream():
    torch.manual_seed(1)
    plain = F.dropout(ONES, 0.5)
    torch.manual_seed(1)
    assert torch.equal(dropout(ONES, 0.5, True), plain)
    assert not torch.equal(dropout(ONES, 0.5, True, DropoutRNG(1)), plain)
    assert dropout(ONES, 0.5, False) is ONES and dropout(ONES, 0.0, True) is ONES


@pytest.mark.parametrize("recompute", [Recompute("selective"), Recompute("full", "uniform", 1)])
def test_recompute_with_dropout_gives_the_same_gradients(recompute):
    config = ModelConfig(**{**PRESETS["tiny-gpt"], "hidden_dropout": 0.3, "attention_dropout": 0.3})
    grads = []
    for setting in (Recompute(), recompute):
        torch.manual_seed(2)
        model = GPTModel(config, recompute=setting).train()
        initialize_parameters(model, seed=3)
        tokens = torch.randint(0, config.vocab_size, (2, 32))
        model(tokens, labels=tokens).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

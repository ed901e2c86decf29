"""Megatron-LM's FLOPs formula against hand-computed values."""

import pytest

from tessera.config import ModelConfig
from tessera.models.presets import PRESETS
from tessera.perf.flops import flops_per_iteration, flops_per_token


def test_gpt3_closed_form():
    """GPT-3 shapes: 72 B s L h^2 (1 + s/(12h) + V/(12 L h)) per iteration (causal halving)."""
    config = ModelConfig(**PRESETS["gpt3-175b"])
    batch, s, layers, h, vocab = 1536, 2048, 96, 12288, 50304
    expected = 72 * batch * s * layers * h**2 * (1 + s / (12 * h) + vocab / (12 * layers * h))
    assert flops_per_iteration(config, batch) == pytest.approx(expected, rel=1e-12)
    no_halving = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert flops_per_iteration(config, batch, causal=False) == pytest.approx(no_halving, rel=1e-12)


def test_swiglu_gqa_by_hand():
    """A small GQA + SwiGLU model, every GEMM written out (forward x 3)."""
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, group_query_attention=True,
                         num_query_groups=2, ffn_hidden_size=160, swiglu=True, seq_length=32, vocab_size=1000,
                         make_vocab_size_divisible_by=128)
    h, d, s, vocab = 64, 16, 32, 1024
    qkv = 2 * h * (4 * d + 2 * 2 * d)
    out = 2 * (4 * d) * h
    mlp = 2 * h * (2 * 160) + 2 * 160 * h
    scores_and_values = 2 * 2 * s * (4 * d) / 2          # causal: half of QK^T and of AV, per token
    logits = 2 * h * vocab
    forward = 2 * (qkv + out + mlp + scores_and_values) + logits
    assert flops_per_token(config) == pytest.approx(3 * forward)


def test_anchor_configs():
    """shared/anchors/NOTES.md: 8.470 GFLOP/token for config A and 7.490 for B."""
    assert flops_per_token(ModelConfig(**PRESETS["gpt3-1.3b"])) / 1e9 == pytest.approx(8.470, abs=5e-4)
    assert flops_per_token(ModelConfig(**PRESETS["llama-1.2b"])) / 1e9 == pytest.approx(7.490, abs=5e-4)

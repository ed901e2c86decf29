"""RoPE scaling: YaRN and llama3 inverse frequencies and factors against transformers' own
rope initialisation functions and against YaRN's formulas (Megatron's yarn_rotary_pos_embedding.py)
(DeepSeek-V3's published correction range 10..23); the interleaved rotation against HF's;
the flags' resolution and bad combinations.

Tolerance: tessera computes in float64, transformers in float32; frequencies agree to a
few float32 ulps (relative 1e-6).
"""

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.rope import apply_rotary
from tessera.models.rope import Llama3Scaling, YarnScaling, build_rotary, rope_scaling

DSV3 = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=1.0)
YARN_CASES = {  # name: (rotary dim, theta, HF rope parameters)
    "deepseek-v3": (64, 10000.0, DSV3),
    "deepseek-v2-lite mscale 0.707": (64, 10000.0, dict(DSV3, mscale=0.707, mscale_all_dim=0.707)),
    "unequal mscales, unrounded range": (64, 10000.0, dict(DSV3, mscale=1.3, mscale_all_dim=0.6, truncate=False)),
    "qwen2.5 yarn (no mscales)": (128, 1e6, dict(factor=4.0, original_max_position_embeddings=32768)),
    "narrow betas": (32, 500.0, dict(factor=8.0, original_max_position_embeddings=1024, beta_fast=8, beta_slow=2)),
}


def _yarn_scaling(params: dict) -> YarnScaling:
    """tessera's YaRN of HF parameters (HF's cos/sin factor falls back to mscale(factor, 1) without both mscales)."""
    both = params.get("mscale") and params.get("mscale_all_dim")
    return YarnScaling(params["factor"], params["original_max_position_embeddings"], params.get("beta_fast", 32),
                       params.get("beta_slow", 1), params["mscale"] if both else 1.0,
                       params["mscale_all_dim"] if both else 0.0, params.get("truncate", True))


def _hf_rope(kind: str, dim: int, theta: float, params: dict, max_positions: int = 163840):
    config = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim,
                                      max_position_embeddings=max_positions,
                                      rope_parameters=dict(params, rope_type=kind, rope_theta=theta))
    return ROPE_INIT_FUNCTIONS[kind](config)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected.double()).abs() / expected.double().abs()).max().item()


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_matches_transformers(case):
    dim, theta, params = YARN_CASES[case]
    expected_inv_freq, expected_factor = _hf_rope("yarn", dim, theta, params)
    scaling = _yarn_scaling(params)
    assert _relative(scaling.inverse_frequencies(dim, theta), expected_inv_freq) <= 1e-6
    assert scaling.attention_factor == pytest.approx(expected_factor, rel=1e-12)


def test_yarn_matches_the_formulas_and_deepseek_v3s_published_range():
    dim, theta, s, original = 64, 10000.0, 40.0, 4096
    scaling = YarnScaling(s, original, 32.0, 1.0, mscale=1.0, mscale_all_dim=1.0)
    assert scaling.correction_range(dim, theta) == (10, 23)   # DeepSeek-V3's YaRN settings: dims 10..23
    correction = [dim * math.log(original / (2 * math.pi * r)) / (2 * math.log(theta)) for r in (32.0, 1.0)]
    assert correction == pytest.approx([10.47, 22.51], abs=0.005)
    low, high = max(math.floor(correction[0]), 0), min(math.ceil(correction[1]), dim - 1)
    expected = []
    for i in range(dim // 2):
        extrapolated = theta ** (-2 * i / dim)
        keep = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
        expected.append(extrapolated / s * (1 - keep) + extrapolated * keep)
    torch.testing.assert_close(scaling.inverse_frequencies(dim, theta), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=0)
    assert scaling.attention_factor == 1.0   # mscale = mscale_all_dim: the cos/sin factors cancel
    unequal = YarnScaling(s, original, mscale=1.0, mscale_all_dim=0.0)
    assert unequal.attention_factor == pytest.approx(0.1 * math.log(40) + 1)


@pytest.mark.parametrize("params", [
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),   # LLaMA 3.1
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),  # LLaMA 3.2
    dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=16.0, original_max_position_embeddings=4096),
], ids=["llama3.1", "llama3.2", "other bands"])
def test_llama3_matches_transformers(params):
    expected_inv_freq, expected_factor = _hf_rope("llama3", 128, 500000.0, params)
    scaling = Llama3Scaling(params["factor"], params["low_freq_factor"], params["high_freq_factor"],
                            params["original_max_position_embeddings"])
    inv_freq = scaling.inverse_frequencies(128, 500000.0)
    assert _relative(inv_freq, expected_inv_freq) <= 1e-6
    assert scaling.attention_factor == expected_factor == 1.0
    unscaled = 500000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
    assert (inv_freq == unscaled).any() and (inv_freq == unscaled / params["factor"]).any()  # all three bands


def test_tables_carry_yarns_factor_and_follow_position_ids():
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=32,
                         position_embedding_type="yarn", rotary_base=500.0, rotary_scaling_factor=8.0,
                         yarn_original_max_position_embeddings=64, mscale=1.2, mscale_all_dim=0.5)
    rotary = build_rotary(config)
    inv_freq, factor = _hf_rope("yarn", 16, 500.0, dict(factor=8.0, original_max_position_embeddings=64, mscale=1.2,
                                                         mscale_all_dim=0.5), max_positions=16)
    positions = torch.tensor([[3, 0, 15, 7]])
    angles = positions[..., None].double() * inv_freq.double()
    cos, sin = rotary(4, positions)
    torch.testing.assert_close(cos[:, :, 0].double(), torch.cat([angles, angles], -1).cos() * factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, :, 0].double(), torch.cat([angles, angles], -1).sin() * factor, rtol=0, atol=1e-6)
    assert factor != 1.0


def test_interleaved_rotation_matches_transformers():
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 3, 8, generator=generator), torch.randn(2, 5, 1, 8, generator=generator)
    angles = torch.rand(5, 4, generator=generator) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    # HF's layout [b, heads, s, d]; tessera's [b, s, heads, d]
    expected_q, expected_k = apply_rotary_pos_emb_interleave(q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None])
    torch.testing.assert_close(apply_rotary(q, cos[:, None], sin[:, None], interleaved=True),
                               expected_q.transpose(1, 2))
    torch.testing.assert_close(apply_rotary(k, cos[:, None], sin[:, None], interleaved=True),
                               expected_k.transpose(1, 2))


_MODEL = dict(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=32)


def test_flags_resolve_to_one_spelling():
    yarn = ModelConfig(**_MODEL, position_embedding_type="yarn", rotary_scaling_factor=4.0,
                       yarn_original_max_position_embeddings=8)
    assert (yarn.position_embedding_type, yarn.rope_type, yarn.yarn_correction_range_round_to_int) == ("rope", "yarn",
                                                                                                       True)
    assert isinstance(rope_scaling(yarn), YarnScaling)
    assert ModelConfig(**_MODEL, position_embedding_type="rope").rope_type == "rope"
    assert ModelConfig(**_MODEL, position_embedding_type="rope", rope_type="yarn").rope_type == "yarn"
    assert rope_scaling(ModelConfig(**_MODEL, position_embedding_type="yarn")) is None   # factor 1: plain RoPE
    llama3 = ModelConfig(**_MODEL, position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=32.0)
    assert rope_scaling(llama3) == Llama3Scaling(32.0, 1.0, 4.0, 8192)   # Megatron's fixed bands as defaults
    for config in (yarn, llama3):   # YAML and checkpoints store the resolved values: they parse back the same
        assert ModelConfig(**vars(config)) == config


@pytest.mark.parametrize("flags, expected", [
    (dict(position_embedding_type="yarn", rotary_scaling_factor=40.0),
     "--rotary-scaling-factor 40.0 (YaRN) needs --yarn-original-max-position-embeddings"),
    (dict(position_embedding_type="rope", rotary_scaling_factor=40.0), "--rotary-scaling-factor needs YaRN"),
    (dict(position_embedding_type="rope", mscale_all_dim=1.0), "--mscale-all-dim needs YaRN"),
    (dict(position_embedding_type="yarn", rope_type="rope"), "--position-embedding-type yarn contradicts --rope-type"),
    (dict(rope_type="yarn"), "--rope-type needs --position-embedding-type rope"),
    (dict(position_embedding_type="yarn", rotary_scaling_factor=0.5),
     "--rotary-scaling-factor (0.5) must be at least 1"),
    (dict(position_embedding_type="yarn", yarn_beta_fast=1.0, yarn_beta_slow=2.0),
     "--yarn-beta-fast (1.0) must exceed --yarn-beta-slow (2.0)"),
    (dict(position_embedding_type="rope", rope_scaling_factor=4.0), "--rope-scaling-factor needs --use-rope-scaling"),
    (dict(position_embedding_type="yarn", use_rope_scaling=True), "--use-rope-scaling (llama3) and YaRN"),
    (dict(use_rope_scaling=True), "--use-rope-scaling needs --position-embedding-type rope"),
    (dict(position_embedding_type="rope", use_rope_scaling=True, rope_scaling_low_freq_factor=4.0),
     "--rope-scaling-low-freq-factor (4.0) must be positive and below --rope-scaling-high-freq-factor (4.0)"),
])
def test_bad_combinations_name_their_flags(flags, expected):
    with pytest.raises(ConfigError) as error:
        ModelConfig(**_MODEL, **flags)
    assert expected in str(error.value) and "\n" not in str(error.value)

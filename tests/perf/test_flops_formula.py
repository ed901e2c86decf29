"""Megatron-LM's FLOPs formula against hand-computed values, MoE included; parameter counts
against the model."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.models.presets import PRESETS
from tessera.perf.flops import count_parameters, flops_per_iteration, flops_per_token


def test_gpt3_closed_form():
    """GPT-3 shapes: 72 B s L h^2 (1 + s/(12h) + V/(12 L h)) per iteration (causal halving)."""
    config = ModelConfig(**PRESETS["gpt3-175b"])
    batch, s, layers, h, vocab = 1536, 2048, 96, 12288, 50304
    expected = 72 * batch * s * layers * h**2 * (1 + s / (12 * h) + vocab / (12 * layers * h))
    assert flops_per_iteration(config, batch) == pytest.approx(expected, rel=1e-12)
    no_halving = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert flops_per_iteration(config, batch, causal=False) == pytest.approx(no_halving, rel=1e-12)


def test_packed_documents_count_attention_per_document():
    """GPT-3 shapes, 1536 samples of 2048 tokens packed with documents of 512 and 1536: the
    closed form's attention term 72 B s L h^2 * s/(12h) follows sum(n^2) instead of B s^2."""
    config = ModelConfig(**PRESETS["gpt3-175b"])
    batch, s, layers, h, vocab = 1536, 2048, 96, 12288, 50304
    squares = batch * (512**2 + 1536**2)
    expected = 72 * layers * h**2 * (batch * s * (1 + vocab / (12 * layers * h)) + squares / (12 * h))
    assert flops_per_iteration(config, batch, squared_document_lengths=squares) == pytest.approx(expected, rel=1e-12)
    # One document per sample is the plain count.
    whole = flops_per_iteration(config, batch, squared_document_lengths=batch * s**2)
    assert whole == pytest.approx(flops_per_iteration(config, batch), rel=1e-12)


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
    # A frozen base (LoRA): every weight GEMM runs forward and for the input's gradient only.
    gemms = qkv + out + mlp
    frozen = 2 * (2 * gemms + 2 * logits / 2) + 3 * 2 * scores_and_values
    assert flops_per_token(config, frozen_base=True) == pytest.approx(frozen)


def test_anchor_configs():
    """Megatron-Core's own count for its reference runs: 8.470 GFLOP/token for config A and 7.490 for B."""
    assert flops_per_token(ModelConfig(**PRESETS["gpt3-1.3b"])) / 1e9 == pytest.approx(8.470, abs=5e-4)
    assert flops_per_token(ModelConfig(**PRESETS["llama-1.2b"])) / 1e9 == pytest.approx(7.490, abs=5e-4)


def megatron_flops(batch, s, layers, h, heads, kv_channels, groups, ffn, vocab, swiglu,
                   moe_ffn=0, topk=0, shared_ffn=0, moe_pattern=None):
    """Megatron's num_floating_point_operations, re-derived from megatron/training/training.py:
    N 3*2*H [F f n_dense + (I k f + I_shared f) n_moe] for the MLPs, 3*2 [H (q + 2 kv) + q H]
    per layer for the projections, 3*2 H V for the logits (N = B s tokens), and the causal core
    attention 3*2 q/2*2 per layer times B s^2."""
    f = 3 if swiglu else 2
    moe_pattern = moe_pattern or [False] * layers
    n_moe = sum(moe_pattern)
    tokens, q, kv = batch * s, heads * kv_channels, groups * kv_channels
    mlp = 3 * 2 * h * (ffn * f * (layers - n_moe) + (moe_ffn * topk * f + shared_ffn * f) * n_moe)
    projections = layers * 3 * 2 * (h * (q + 2 * kv) + q * h)
    logits = 3 * 2 * h * vocab
    core = layers * 3 * 2 * q / 2 * 2
    return tokens * (mlp + projections + logits) + batch * s * s * core


def test_mixtral_8x7b_matches_megatron():
    config = ModelConfig(**PRESETS["mixtral-8x7b"])
    expected = megatron_flops(256, 4096, 32, 4096, 32, 128, 8, 14336, 32000, True, moe_ffn=14336, topk=2,
                              moe_pattern=[True] * 32)
    assert flops_per_iteration(config, 256) == pytest.approx(expected, rel=1e-12)


def test_qwen3_30b_a3b_matches_megatron():
    config = ModelConfig(**PRESETS["qwen3-30b-a3b"])
    expected = megatron_flops(64, 4096, 48, 2048, 32, 128, 4, 6144, 151936, True, moe_ffn=768, topk=8,
                              moe_pattern=[True] * 48)
    assert flops_per_iteration(config, 64) == pytest.approx(expected, rel=1e-12)


def test_dense_prefix_and_shared_expert_match_megatron():
    # Two dense layers, then MoE layers with a gated shared expert (the shared gate and the
    # router are not counted); GeLU, so f = 2.
    config = ModelConfig(num_layers=6, hidden_size=512, num_attention_heads=8, group_query_attention=True,
                         num_query_groups=2, ffn_hidden_size=2048, seq_length=1024, vocab_size=1000,
                         disable_bias_linear=True, num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=256,
                         moe_shared_expert_intermediate_size=1024, moe_shared_expert_gate=True,
                         moe_layer_freq="([0]*2+[1]*4)")
    pattern = [False, False, True, True, True, True]
    expected = megatron_flops(8, 1024, 6, 512, 8, 64, 2, 2048, 1024, False, moe_ffn=256, topk=4, shared_ffn=1024,
                              moe_pattern=pattern)
    assert flops_per_iteration(config, 8) == pytest.approx(expected, rel=1e-12)


def test_moe_parameters_are_those_of_the_model_built_on_meta():
    """count_parameters against GPTModel itself: a dense first layer, gated shared experts, QK
    norm, untied output layer; active = total minus the E - k unused experts of each MoE layer."""
    from tessera.models.gpt import GPTModel

    config = ModelConfig(**{**PRESETS["tiny-moe"], "qk_layernorm": True, "moe_shared_expert_gate": True,
                            "untie_embeddings_and_output_weights": True})
    with torch.device("meta"):
        model = GPTModel(config)
    counted = count_parameters(config)
    assert counted.total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert counted.inactive == experts * (4 - 2) // 4
    assert counted.active == counted.total - counted.inactive


def test_published_moe_sizes():
    """Total and active parameters as their model cards give them (B = 1e9, to 0.1 B: rounded
    or truncated; Qwen3-30B-A3B's 3.35 B active is given as 3.3)."""
    for name, total, active in [("mixtral-8x7b", 46.7, 12.9), ("mixtral-8x22b", 140.6, 39.2),
                                ("qwen1.5-moe-a2.7b", 14.3, 2.7), ("qwen3-30b-a3b", 30.5, 3.3),
                                ("qwen3-235b-a22b", 235.1, 22.2)]:
        params = count_parameters(ModelConfig(**PRESETS[name]))
        assert params.total / 1e9 == pytest.approx(total, abs=0.06), name
        assert params.active / 1e9 == pytest.approx(active, abs=0.06), name


@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_mla_parameters_and_flops(q_lora_rank):
    """MLA: parameters against GPTModel built on meta; FLOPs = 6 x the projections' weights per
    token (counted from the model's own attention weights) + the core term with the score GEMM
    as wide as the query heads and the value GEMM as the value heads."""
    from tessera.models.gpt import GPTModel

    config = ModelConfig(**{**PRESETS["tiny-llama"], "multi_latent_attention": True, "num_query_groups": None,
                            "group_query_attention": False, "position_embedding_type": "rope", "q_lora_rank": q_lora_rank, "kv_lora_rank": 32,
                            "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 24, "qk_layernorm": True,
                            "disable_bias_linear": False})
    with torch.device("meta"):
        model = GPTModel(config)
    assert count_parameters(config).total == sum(p.numel() for p in model.parameters())
    attention = model.layers[0].attention
    weights = sum(m.weight.numel() for m in attention.modules() if getattr(m, "weight", None) is not None
                  and m.weight.dim() == 2)
    s, n, L, h = config.seq_length, config.num_attention_heads, config.num_layers, config.hidden_size
    core = n * ((16 + 8) + 24) / 2 * s
    mlp = 3 * h * config.ffn_hidden_size
    expected = 6 * (L * (weights + mlp + core) + h * config.padded_vocab_size())
    assert flops_per_token(config) == pytest.approx(expected, rel=1e-12)

"""Named architectures for `--model PRESET`; command-line flags override any value.

Values are ModelConfig fields (Megatron-LM flag names) from each family's published
configuration. `seq_length` is a sensible training length, not the longest supported.
"""

from __future__ import annotations

from tessera.config import ConfigError

_GPT = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", vocab_size=50257)
_LLAMA = dict(
    position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
    untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
)
_QWEN = dict(_LLAMA, add_qkv_bias=True, norm_epsilon=1e-6, rotary_base=1_000_000.0)


def _gpt(layers: int, hidden: int, heads: int, seq: int) -> dict:
    return dict(_GPT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                seq_length=seq, max_position_embeddings=seq)


def _moe(experts: int, topk: int, expert_ffn: int, **extra) -> dict:
    """MoE fields of a preset: experts in every layer, softmax routing, fp32 router, grouped GEMMs."""
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=expert_ffn,
                moe_router_dtype="fp32", moe_grouped_gemm=True, **extra)


def _deepseek(layers: int, hidden: int, heads: int, ffn: int, vocab: int, dense_layers: int, q_lora: int | None,
              **extra) -> dict:
    """DeepSeek-V2/V3 shapes: MLA (latent 512, heads of 128 + 64 RoPE channels, values 128) with
    its latent norms, and MoE after `dense_layers` dense ones (the HF config's first_k_dense_replace)."""
    mla = dict(multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=512, qk_head_dim=128,
               qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True)
    return {**_LLAMA, "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "ffn_hidden_size": ffn, "vocab_size": vocab, "seq_length": 4096, "norm_epsilon": 1e-6, **mla,
            "moe_layer_freq": f"([0]*{dense_layers}+[1]*{layers - dense_layers})", **extra}


def _yarn(factor: float, mscale: float, beta_fast: float = 32.0, beta_slow: float = 1.0) -> dict:
    """YaRN from an original 4096-token context, with mscale = mscale_all_dim as DeepSeek's configs set them."""
    return dict(rope_type="yarn", rotary_scaling_factor=factor, yarn_original_max_position_embeddings=4096,
                yarn_beta_fast=beta_fast, yarn_beta_slow=beta_slow, mscale=mscale, mscale_all_dim=mscale)


# DeepSeek-V3's router: sigmoid scores, aux-loss-free balancing by an expert bias, top-k renormalised
# and scaled; the sequence-wise balance loss of the V3 report (alpha 1e-4).
_SIGMOID_ROUTER = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                       moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-4])


def _gpt_oss(layers: int, experts: int, **extra) -> dict:
    """GPT-OSS (OpenAI, 2025; transformers' GptOssConfig and the model card): GQA 64 heads of 64 over 8
    groups, attention sinks, a 128-token window on every other layer (the first windowed), biases on every
    projection and the router, top-4 experts with the clamped quick-GELU gate, YaRN x32 from 4096 tokens."""
    return dict(_LLAMA, swiglu=False, disable_bias_linear=False, num_layers=layers, hidden_size=2880,
                ffn_hidden_size=2880, num_attention_heads=64, group_query_attention=True, num_query_groups=8,
                kv_channels=64, vocab_size=201088, seq_length=4096, max_position_embeddings=131072,
                rotary_base=150_000.0, **dict(_yarn(32.0, 1.0), mscale_all_dim=0.0),
                yarn_correction_range_round_to_int=False, quick_geglu=True, glu_linear_offset=1.0,
                activation_func_clamp_value=7.0, softmax_type="learnable", window_size=(127, 0),
                window_attn_skip_freq="2", **_moe(experts, 4, 2880, moe_aux_loss_coeff=[0.001]), **extra)


def _hybrid(pattern: str, hidden: int, heads: int, groups: int, ffn: int, vocab: int, seq: int, **extra) -> dict:
    """A Megatron-Core hybrid stack (examples/mamba/train.sh): one layer per symbol of `pattern`, no
    positions, RMSNorm, GeLU MLPs, no biases, untied output, no dropout, GQA; the Mamba-2 layers at
    Megatron's defaults (state 128, heads of 64 channels, 8 groups, 2 x hidden inner channels)."""
    return dict(hybrid_layer_pattern=pattern, hidden_size=hidden, num_attention_heads=heads,
                group_query_attention=True, num_query_groups=groups, ffn_hidden_size=ffn, vocab_size=vocab,
                seq_length=seq, max_position_embeddings=seq, position_embedding_type="none", normalization="RMSNorm",
                disable_bias_linear=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                attention_dropout=0.0, **extra)


def _qwen3_next(pattern: str, hidden: int, heads: int, groups: int, head_dim: int, vocab: int, seq: int,
                positions: int, **extra) -> dict:
    """Qwen3-Next's hybrid stack: Gated DeltaNet (G) and gated full attention (*) with QK norm and a quarter
    of each head rotated, each followed by a MoE (E) with a gated shared expert; zero-centred RMSNorms."""
    return dict(hybrid_layer_pattern=pattern, hidden_size=hidden, num_attention_heads=heads,
                group_query_attention=True, num_query_groups=groups, kv_channels=head_dim, vocab_size=vocab,
                seq_length=seq, max_position_embeddings=positions, position_embedding_type="rope",
                rotary_percent=0.25, normalization="RMSNorm", layernorm_zero_centered_gamma=True, norm_epsilon=1e-6,
                swiglu=True, disable_bias_linear=True, qk_layernorm=True, attention_output_gate=True,
                untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, **extra)


def _nemotron_h(attention_layers: int, hidden: int, heads: int, ffn: int, **extra) -> dict:
    """Nemotron-H (arXiv 2504.03624): Megatron's hybrid with squared-ReLU MLPs, an attention layer
    after every fifth Mamba-2 layer but the last (the pattern of Megatron-LM's
    examples/rl/model_configs/nemotron5_{8b,56b}.sh), 8 KV groups and the 131072-token vocabulary
    (the model cards' config.json)."""
    pattern = "M-M-M-M*-" + "M-M-M-M-M*-" * (attention_layers - 1) + "M-M-M-M-M-"
    return _hybrid(pattern, hidden, heads, 8, ffn, 131072, 8192, squared_relu=True, **extra)


def _llama(layers: int, hidden: int, heads: int, groups: int, ffn: int, vocab: int, seq: int, **extra) -> dict:
    gqa = dict(group_query_attention=True, num_query_groups=groups) if groups != heads else {}
    return dict(_LLAMA, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                ffn_hidden_size=ffn, vocab_size=vocab, seq_length=seq, **gqa, **extra)


PRESETS: dict[str, dict] = {
    # GPT-2 (Radford et al. 2019)
    "gpt2-small": _gpt(12, 768, 12, 1024),
    "gpt2-medium": _gpt(24, 1024, 16, 1024),
    "gpt2-large": _gpt(36, 1280, 20, 1024),
    "gpt2-xl": _gpt(48, 1600, 25, 1024),
    # GPT-3 (Brown et al. 2020, table 2.1; 13B uses Megatron's 5120 width)
    "gpt3-1.3b": _gpt(24, 2048, 16, 2048),
    "gpt3-2.7b": _gpt(32, 2560, 32, 2048),
    "gpt3-6.7b": _gpt(32, 4096, 32, 2048),
    "gpt3-13b": _gpt(40, 5120, 40, 2048),
    "gpt3-175b": _gpt(96, 12288, 96, 2048),
    # LLaMA family
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192, rotary_base=500_000.0),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192, rotary_base=500_000.0),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256, 8192, rotary_base=500_000.0),
    # The LLaMA-style 1.2B benchmark shape (config B of bench/train_mfu.py)
    "llama-1.2b": _llama(24, 2048, 16, 4, 5632, 32000, 2048, rotary_base=500_000.0),
    # Qwen2.5 (QKV bias, RoPE theta 1e6; the 0.5B ties its embeddings)
    "qwen2.5-0.5b": dict(_llama(24, 896, 14, 2, 4864, 151936, 4096, **_QWEN),
                         untie_embeddings_and_output_weights=False),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, 4096, **_QWEN),
    "qwen2.5-72b": _llama(80, 8192, 64, 8, 29568, 152064, 4096, **_QWEN),
    # Mistral 7B v0.3 (no sliding window)
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32768, 4096, rotary_base=1_000_000.0),
    # Mixtral (Mistral's attention, 8 experts, top-2 softmax renormalised over the two; aux loss 0.02)
    "mixtral-8x7b": _llama(32, 4096, 32, 8, 14336, 32000, 4096, rotary_base=1_000_000.0,
                           **_moe(8, 2, 14336, moe_aux_loss_coeff=[0.02])),
    "mixtral-8x22b": _llama(56, 6144, 48, 8, 16384, 32768, 4096, rotary_base=1_000_000.0,
                            **_moe(8, 2, 16384, moe_aux_loss_coeff=[0.001])),
    # Qwen MoE: Qwen1.5-MoE (= Qwen2-MoE) has a gated shared expert and does not renormalise
    # the top-k (pre-softmax); Qwen3-MoE renormalises, has no shared expert, QK norm.
    "qwen1.5-moe-a2.7b": _llama(24, 2048, 16, 16, 5632, 151936, 4096, **_QWEN,
                                **_moe(60, 4, 1408, moe_router_pre_softmax=True, moe_aux_loss_coeff=[0.001],
                                       moe_shared_expert_intermediate_size=5632, moe_shared_expert_gate=True)),
    "qwen3-30b-a3b": _llama(48, 2048, 32, 4, 6144, 151936, 4096, **dict(_QWEN, add_qkv_bias=False), kv_channels=128,
                            qk_layernorm=True, **_moe(128, 8, 768, moe_aux_loss_coeff=[0.001])),
    "qwen3-235b-a22b": _llama(94, 4096, 64, 4, 12288, 151936, 4096, **dict(_QWEN, add_qkv_bias=False),
                              kv_channels=128, qk_layernorm=True, **_moe(128, 8, 1536, moe_aux_loss_coeff=[0.001])),
    # DeepSeek-V2-Lite (16B, 2.4B active): no query latent; softmax routing over 64 experts without
    # renormalisation, 2 shared experts; the remote code's sequence-wise aux loss (alpha 1e-3)
    "deepseek-v2-lite": _deepseek(27, 2048, 16, 10944, 102400, 1, None, **_yarn(40.0, 0.707),
                                  **_moe(64, 6, 1408, moe_router_pre_softmax=True,
                                         moe_shared_expert_intermediate_size=2816,
                                         moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-3])),
    # DeepSeek-V3 (671B, 37B active, and one MTP depth of 11.5B more): 8 groups of 32 experts, 4 of them
    # per token
    "deepseek-v3": _deepseek(61, 7168, 128, 18432, 129280, 3, 1536, **_yarn(40.0, 1.0), mtp_num_layers=1,
                             **_moe(256, 8, 2048, **_SIGMOID_ROUTER, moe_router_topk_scaling_factor=2.5,
                                    moe_router_num_groups=8, moe_router_group_topk=4,
                                    moe_shared_expert_intermediate_size=2048)),
    # Moonlight-16B-A3B (Moonshot; DeepSeek-V3's architecture at V2-Lite's size): RoPE base 5e4 without
    # YaRN, norms at 1e-5 but the latents' at HF's fixed 1e-6, aux loss 1e-3
    "moonlight-16b-a3b": _deepseek(27, 2048, 16, 11264, 163840, 1, None, rope_type="rope", rotary_base=50_000.0,
                                   norm_epsilon=1e-5, latent_norm_epsilon=1e-6,
                                   **_moe(64, 6, 1408, **dict(_SIGMOID_ROUTER, moe_aux_loss_coeff=[1e-3]),
                                          moe_router_topk_scaling_factor=2.446,
                                          moe_shared_expert_intermediate_size=2816)),
    # Kimi-K2 (Moonshot, 1T, 32B active; July 2025 release): DeepSeek-V3 with 64 heads, 384 experts
    # without groups, one dense layer, YaRN x32 with both betas 1 over RoPE base 5e4
    "kimi-k2": _deepseek(61, 7168, 64, 18432, 163840, 1, 1536, rotary_base=50_000.0,
                         **_yarn(32.0, 1.0, beta_fast=1.0, beta_slow=1.0),
                         **_moe(384, 8, 2048, **_SIGMOID_ROUTER, moe_router_topk_scaling_factor=2.827,
                                moe_shared_expert_intermediate_size=2048)),
    # GPT-OSS (21B with 3.6B active; 117B with 5.1B active)
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    # The Mamba-2 hybrid of "An Empirical Study of Mamba-based Language Models" (arXiv 2406.07887):
    # 56 layers, 24 Mamba-2, 4 attention, 28 MLP; its 256K-token vocabulary
    "mamba2-hybrid-8b": _hybrid("M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-", 4096, 32, 8, 16384,
                                256000, 4096),
    # Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig, whose defaults are this model's): 48 layers, three
    # Gated DeltaNet to one gated attention, 512 experts (top-10) and a gated shared expert after each
    "qwen3-next-80b-a3b": _qwen3_next("GEGEGE*E" * 12, 2048, 16, 2, 256, 151936, 4096, 262144,
                                      ffn_hidden_size=5120, rotary_base=10_000_000.0,
                                      **_moe(512, 10, 512, moe_shared_expert_intermediate_size=512,
                                             moe_shared_expert_gate=True, moe_aux_loss_coeff=[0.001])),
    # Nemotron-H-8B-Base-8K and -56B-Base-8K (Megatron-LM's examples/rl/model_configs/nemotron5_{8b,56b}.sh;
    # transformers' NemotronHConfig defaults are the 8B's): 52 layers (24 Mamba-2, 4 attention, 24 MLP) and
    # 118 (54, 10, 54); the 56B's SSM state is 256 wide
    "nemotron-h-8b": _nemotron_h(4, 4096, 32, 21504, init_method_std=0.014),
    "nemotron-h-56b": _nemotron_h(10, 8192, 64, 32768, mamba_state_dim=256, init_method_std=0.0099),
    # Tiny shapes for tests and CPU demos
    "tiny-gpt": dict(_gpt(2, 64, 4, 64), vocab_size=256, make_vocab_size_divisible_by=8),
    "tiny-llama": dict(_llama(2, 64, 4, 2, 176, 256, 64), make_vocab_size_divisible_by=8),
    # Mamba-2, attention and MLP layers: 8 SSM heads of 16 channels in 2 groups, state 16
    "tiny-hybrid": _hybrid("M*-M-", 64, 4, 2, 128, 256, 64, mamba_state_dim=16, mamba_head_dim=16,
                           mamba_num_groups=2, make_vocab_size_divisible_by=8),
    # Nemotron-H's layers and Nemotron-3's MoE in miniature: squared ReLU, 4 experts (top-2, sigmoid
    # router with an expert bias, x2.5) and a shared expert
    "tiny-nemotron-h": _hybrid("M-*EM-", 64, 4, 2, 96, 256, 64, squared_relu=True, mamba_state_dim=16,
                               mamba_head_dim=16, mamba_num_groups=2, make_vocab_size_divisible_by=8,
                               **_moe(4, 2, 48, **_SIGMOID_ROUTER, moe_router_topk_scaling_factor=2.5,
                                      moe_shared_expert_intermediate_size=32)),
    # Qwen3-Next in miniature: two Gated DeltaNet and two gated attention layers, MoE after three of them
    # (4 experts, top-2, a gated shared expert) and a dense MLP after one
    "tiny-qwen3-next": dict(_qwen3_next("GE*EG-*E", 64, 4, 2, 16, 256, 64, 64, ffn_hidden_size=96,
                                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                        linear_value_head_dim=16, make_vocab_size_divisible_by=8,
                                        **_moe(4, 2, 32, moe_shared_expert_intermediate_size=32,
                                               moe_shared_expert_gate=True, moe_aux_loss_coeff=[1e-2])),
                            moe_grouped_gemm=False),
    # 4 layers, the first dense; 4 experts, top-2, a shared expert, aux loss on
    "tiny-moe": dict(_llama(4, 64, 4, 2, 176, 256, 64, moe_layer_freq="([0]*1+[1]*3)",
                            **_moe(4, 2, 48, moe_aux_loss_coeff=[1e-2], moe_shared_expert_intermediate_size=32)),
                     make_vocab_size_divisible_by=8, moe_grouped_gemm=False),
    # DeepSeek-V3 in miniature: MLA with a query latent and YaRN, one dense layer, then 16 sigmoid-routed
    # experts in 4 groups (top-4 from the best 2 groups, as V3's 8 from 4: groups scored by their best 2;
    # expert bias, scaled), a shared expert, one MTP depth
    "tiny-deepseek": dict(_deepseek(3, 64, 4, 176, 256, 1, 32, **_yarn(4.0, 1.0), mtp_num_layers=1,
                                    **_moe(16, 4, 16, **_SIGMOID_ROUTER, moe_router_topk_scaling_factor=2.5,
                                           moe_router_num_groups=4, moe_router_group_topk=2,
                                           moe_shared_expert_intermediate_size=16)),
                          kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, seq_length=64,
                          yarn_original_max_position_embeddings=16, make_vocab_size_divisible_by=8,
                          moe_grouped_gemm=False),
    # GPT-OSS in miniature: 4 layers alternating a 7-token window and full attention, sinks, 4 biased
    # experts (top-2) with the clamped gate, YaRN x4 from 16 tokens
    "tiny-gpt-oss": dict(_gpt_oss(4, 4), hidden_size=64, ffn_hidden_size=48, moe_ffn_hidden_size=48,
                         num_attention_heads=4, num_query_groups=2, kv_channels=16, vocab_size=256,
                         make_vocab_size_divisible_by=8, seq_length=64, max_position_embeddings=64,
                         yarn_original_max_position_embeddings=16, rotary_scaling_factor=4.0, window_size=(7, 0),
                         moe_aux_loss_coeff=[1e-2], moe_grouped_gemm=False),
}


def preset_values(name: str) -> dict:
    """The ModelConfig fields of a preset; an unknown name lists the known ones."""
    if name not in PRESETS:
        raise ConfigError(f"--model {name}: unknown preset; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])

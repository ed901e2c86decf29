"""Parameter counts and model FLOPs, by Megatron-LM's formula (MFU-style).

Model FLOPs count the work of one forward and one backward pass; recomputation is not
counted, so MFU does not reward recomputing. A multiply-add is 2 FLOPs, and backward
costs twice forward (input gradient + weight gradient), hence the factor 6 = 2 x 3 on
every GEMM with one operand a weight. Per token, with h = hidden, q = heads x head dim,
kv = query groups x head dim, f = ffn width, G = 3 gated (SwiGLU) or 2 (GeLU), V = padded
vocabulary and L = layers:

    linear  = 6 * [ L * ( h*(q + 2*kv)      QKV projection
                        + q*h                attention output projection
                        + G*h*f )            MLP (gate and up, down)
                    + h*V ]                  logits

Core attention (Q K^T and A V, each 2*s*q FLOPs per token forward) is causal: only the
lower triangle of the s x s scores is needed, so each GEMM counts half, giving per token

    attention = 6 * L * q * s      ( = 3 passes * 2 FLOP * 2 GEMMs * q * s / 2 )

With packed documents attending within themselves only (--reset-attention-mask), a
document of n tokens costs n times its own length, not s: the attention term of an
iteration is 6 * L * q * sum(n^2) over its documents, as Megatron counts packed (THD)
sequences; `squared_document_lengths` gives that sum.

With multi-latent attention (DeepSeek's MLA) the projections are its down and up
projections (per token: h*r_q + r_q*n*(d_qk+d_pe) for the query, or h*n*(d_qk+d_pe) without
a query latent; h*(r_kv+d_pe) + r_kv*n*(d_qk+d_v) for keys and values; n*d_v*h out), and q in
the attention term becomes n*((d_qk+d_pe) + d_v)/2: the score GEMM is as wide as the query
heads, the value GEMM as the value heads.

For GPT-3 shapes (q = kv = h, f = 4h) this is 72*B*s*L*h^2 * (1 + s/(12h) + V/(12*L*h)) per
iteration, the sanity check in Megatron-LM. Megatron before March 2025 counted attention
without the causal halving (s/(6h) instead of s/(12h)); `causal=False` gives that count.

In a MoE layer the MLP term is the work a token really does, as Megatron counts it: its k
routed experts and the shared expert, G*h*(k*f_moe + f_shared); the router's h x E GEMM
is not counted. So MFU is measured on active parameters. (Before March 2025 Megatron
counted k*f with the dense f and no shared expert: the same for Mixtral, where f_moe = f.)

A hybrid stack (--hybrid-layer-pattern) counts each layer by its kind, as Megatron's hybrid_flops
(megatron/training/training.py, num_floating_point_operations): the attention terms for `*`
layers only, the MLP or MoE term for `-` and `E` layers, and for each Mamba-2 layer `M`, with
d = heads x head dim inner channels, g groups, N the state size and n heads,

    mamba = 6 * h * (2*d + 2*g*N + n)     in_proj
          + 3 * 7 * d * N                 the scan (Megatron's estimate)
          + 6 * d * h                     out_proj

(Megatron writes d = 2h, which it is unless --mamba-num-heads says otherwise.) Each Gated DeltaNet
layer `G`, with qk = key heads x key head dim, v = value heads x value head dim, n value heads of
V channels and K conv taps, as Megatron's gdn_layer_flops (its V^2 assumes key and value heads
of one width):

    gdn = 6 * ( h * (2*qk + 2*v + 2*n)     in_proj
              + K * (2*qk + v)             conv
              + 4 * n * V^2                the delta rule (K K^T, V K^T, the state update, S q)
              + v * h )                    out_proj

With --attention-output-gate the query projection is twice as wide (the gate's h x q GEMM is
counted, as Megatron's transformer formula counts it).

Sliding-window attention (--window-size) is counted as Megatron counts it: not at all, each
windowed layer's core attention counted as full causal attention over s (so GPT-OSS's
attention term is overstated at long sequences, by Megatron's convention, and MFUs compare);
sink logits cost nothing worth counting. A gated MLP counts G = 3 whether --swiglu or
--quick-geglu (Megatron's formula keys on --swiglu alone and would count GPT-OSS's experts as
2: the GEMMs are three).

Multi-token prediction (--mtp-num-layers D), as Megatron counts it: each depth is one more
layer of the last layer's kind (attention, core attention and MLP terms), plus its norms and
projection 6 * (3h + 2h^2), and one more pass through the output layer, 6 * h*V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from tessera.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    embedding: int       # word and position embeddings, and an untied output layer
    non_embedding: int   # transformer blocks and the final norm
    inactive: int = 0    # routed-expert weights a token does not use (E - k experts of each MoE layer)
    mtp: int = 0         # of the non-embedding ones, the MTP depths' (DeepSeek quotes its sizes without them)

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding

    @property
    def active(self) -> int:
        """Parameters one token computes with."""
        return self.total - self.inactive


class LayerParameters(NamedTuple):
    """One transformer block's parameters, split the way expert parallelism splits them."""

    dense: int     # attention, norms, and the dense MLP or the router and shared expert: the same on every EP rank
    experts: int   # the routed experts, all E of them: sharded by EP x ETP


def _norm_params(config: ModelConfig, width: int | None = None) -> int:
    return (width or config.hidden_size) * (2 if config.normalization == "LayerNorm" else 1)


def _mlp_params(config: ModelConfig, ffn: int) -> int:
    gate = 2 if config.gated_linear_unit else 1
    return (gate + 1) * config.hidden_size * ffn + (gate * ffn + config.hidden_size) * config.add_bias_linear


def attention_projections(config: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) features of each projection of one attention block, once per token."""
    h, n = config.hidden_size, config.num_attention_heads
    if not config.multi_latent_attention:
        q, kv = n * config.kv_channels, config.num_query_groups * config.kv_channels
        return [(h, q * (1 + config.attention_output_gate) + 2 * kv), (q, h)]
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    query = [(h, n * qk)] if config.q_lora_rank is None else [(h, config.q_lora_rank), (config.q_lora_rank, n * qk)]
    return query + [(h, config.kv_lora_rank + config.qk_pos_emb_head_dim),
                    (config.kv_lora_rank, n * (config.qk_head_dim + config.v_head_dim)), (n * config.v_head_dim, h)]


def _attention_params(config: ModelConfig) -> int:
    projections = attention_projections(config)
    weights = sum(i * o for i, o in projections)
    if config.multi_latent_attention:   # every projection may carry a bias; the latents' norms
        biases = sum(o for _, o in projections) * config.add_bias_linear
        latents = [config.kv_lora_rank] + ([config.q_lora_rank] if config.q_lora_rank else [])
        norms = sum(_norm_params(config, w) for w in latents) if config.qk_layernorm else 0
        return weights + biases + norms
    (_, qkv), _ = projections
    biases = qkv * (config.add_bias_linear or config.add_qkv_bias) + config.hidden_size * config.add_bias_linear
    norms = 2 * _norm_params(config, config.kv_channels) if config.qk_layernorm else 0
    sinks = config.num_attention_heads if config.softmax_type == "learnable" else 0
    return weights + biases + norms + sinks


def _core_attention_width(config: ModelConfig) -> int:
    """Channels of the two attention GEMMs summed over heads, halved: q.k (query/key width)
    and p.v (value width); without MLA both are the heads' width, so this is q."""
    if not config.multi_latent_attention:
        return config.num_attention_heads * config.kv_channels
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    return config.num_attention_heads * (qk + config.v_head_dim) // 2


def layer_parameters(config: ModelConfig) -> list[LayerParameters]:
    """Exact parameters of each block of GPTModel(config)."""
    if config.hybrid_layer_pattern is not None:
        return _hybrid_layer_parameters(config)
    common = _attention_params(config) + 2 * _norm_params(config)
    dense = LayerParameters(common + _mlp_params(config, config.ffn_hidden_size), 0)
    if config.num_experts is None:
        return [dense] * config.num_layers
    moe = _moe_params(config)
    moe = LayerParameters(common + moe.dense, moe.experts)
    return [moe if is_moe else dense for is_moe in config.moe_layers()]


def _moe_params(config: ModelConfig) -> LayerParameters:
    """A MoE block without its norm: the router and shared expert, and the routed experts."""
    h = config.hidden_size
    router = config.num_experts * (h + config.add_bias_linear) + h * config.moe_shared_expert_gate
    shared_ffn = config.moe_shared_expert_intermediate_size
    shared = _mlp_params(config, shared_ffn) if shared_ffn else 0
    return LayerParameters(router + shared, config.num_experts * _mlp_params(config, config.moe_ffn_hidden_size))


def _mamba_shape(config: ModelConfig) -> tuple[int, int, int]:
    """(inner channels d, B and C's channels g*N, heads n) of a Mamba-2 mixer."""
    heads = config.mamba_num_heads
    return heads * config.mamba_head_dim, config.mamba_num_groups * config.mamba_state_dim, heads


def _mamba_params(config: ModelConfig) -> int:
    """in_proj, conv (weights of CONV_KERNEL taps and a bias per channel), dt_bias, A_log, D, the gated
    norm and out_proj (tessera.models.mamba)."""
    from tessera.models.mamba import CONV_KERNEL

    h, (inner, states, heads) = config.hidden_size, _mamba_shape(config)
    projected = 2 * inner + 2 * states + heads
    biases = (projected + h) * config.add_bias_linear
    return h * projected + (inner + 2 * states) * (CONV_KERNEL + 1) + 3 * heads + inner + inner * h + biases


def _gdn_shape(config: ModelConfig) -> tuple[int, int, int]:
    """(query/key channels qk, value channels v, value heads n) of a Gated DeltaNet mixer."""
    heads = config.linear_num_value_heads
    return config.linear_num_key_heads * config.linear_key_head_dim, heads * config.linear_value_head_dim, heads


def _gdn_params(config: ModelConfig) -> int:
    """in_proj, conv (no bias), dt_bias, A_log, the gated norm (one head wide) and out_proj
    (tessera.models.gated_deltanet)."""
    h, (qk, v, heads) = config.hidden_size, _gdn_shape(config)
    projected = 2 * qk + 2 * v + 2 * heads
    biases = (projected + h) * config.add_bias_linear
    return (h * projected + (2 * qk + v) * config.linear_conv_kernel_dim + 2 * heads + config.linear_value_head_dim
            + v * h + biases)


def _hybrid_layer_parameters(config: ModelConfig) -> list[LayerParameters]:
    from tessera.config.hybrid import ATTENTION, GATED_DELTANET, MAMBA, MLP, layer_symbols

    norm = _norm_params(config)
    symbols = layer_symbols(config.hybrid_layer_pattern)
    kinds = {ATTENTION: LayerParameters(norm + _attention_params(config), 0),
             MLP: LayerParameters(norm + _mlp_params(config, config.ffn_hidden_size), 0)}
    if config.num_experts is not None:
        moe = _moe_params(config)
        kinds["E"] = LayerParameters(norm + moe.dense, moe.experts)
    if MAMBA in symbols:
        kinds[MAMBA] = LayerParameters(norm + _mamba_params(config), 0)
    if GATED_DELTANET in symbols:
        kinds[GATED_DELTANET] = LayerParameters(norm + _gdn_params(config), 0)
    return [kinds[symbol] for symbol in symbols]


def count_parameters(config: ModelConfig, vocab_size: int | None = None) -> ParamCount:
    """Exact parameter count of GPTModel(config); `vocab_size` defaults to the padded vocabulary."""
    depths = config.mtp_num_layers or 0
    main = layer_parameters(config)
    # An MTP depth: a block of the last layer's kind, two input norms, the 2h -> h projection, a final norm.
    mtp_layers = main[-1:] * depths
    mtp = sum(map(sum, mtp_layers)) + depths * (3 * _norm_params(config) + 2 * config.hidden_size ** 2)
    experts = sum(layer.experts for layer in main + mtp_layers)
    inactive = experts // config.num_experts * (config.num_experts - config.moe_router_topk) if experts else 0
    non_embedding = sum(map(sum, main)) + _norm_params(config) + mtp
    vocab = vocab_size if vocab_size is not None else config.padded_vocab_size()
    embedding = vocab * config.hidden_size * (1 if config.tie_embeddings else 2)
    if config.position_embedding_type == "learned_absolute":
        embedding += config.max_position_embeddings * config.hidden_size
    return ParamCount(embedding, non_embedding, inactive, mtp)


def _mlp_widths(config: ModelConfig) -> list[int]:
    """Per layer, the FFN width one token goes through: the dense MLP's, or its k routed
    experts' and the shared expert's together (the router is not counted, as in Megatron)."""
    routed = config.moe_router_topk * (config.moe_ffn_hidden_size or 0)
    moe = routed + (config.moe_shared_expert_intermediate_size or 0)
    with_mlp = [True] * (config.num_layers + (config.mtp_num_layers or 0))
    if config.hybrid_layer_pattern is not None:   # only the MLP and MoE layers have one
        with_mlp = [symbol in "-E" for symbol in _hybrid_symbols(config)]
    return [moe if is_moe else config.ffn_hidden_size
            for is_moe, has_mlp in zip(config.moe_layers(with_mtp=True), with_mlp) if has_mlp]


def _hybrid_symbols(config: ModelConfig) -> list[str]:
    from tessera.config.hybrid import layer_symbols

    return layer_symbols(config.hybrid_layer_pattern)


def flops_per_token(config: ModelConfig, seq_length: int | None = None, vocab_size: int | None = None,
                    causal: bool = True, frozen_base: bool = False) -> float:
    """Model FLOPs (forward + backward) per trained token. `frozen_base` (LoRA): the frozen
    weights' GEMMs compute no weight gradient, 4 FLOPs per weight and token instead of 6, as
    PEFT's users count them (the adapters' own GEMMs, under 1% of a layer's at rank 16, and the
    Mamba-2 and Gated DeltaNet layers' projections keep Megatron's count)."""
    h, depths = config.hidden_size, config.mtp_num_layers or 0
    layers = _attention_layers(config)
    s = seq_length if seq_length is not None else config.seq_length
    vocab = vocab_size if vocab_size is not None else config.padded_vocab_size()
    gated = 3 if config.gated_linear_unit else 2
    projections = sum(i * o for i, o in attention_projections(config))
    mtp = depths * (3 * h + 2 * h * h)   # Megatron's count of the depths' norms and projections
    linear = layers * projections + gated * h * sum(_mlp_widths(config)) + mtp + h * vocab * (1 + depths)
    attention = layers * _core_attention_width(config) * s * (1 if causal else 2)
    return (4.0 if frozen_base else 6.0) * linear + 6.0 * attention + _mixer_flops(config)


def _mixer_flops(config: ModelConfig) -> float:
    """Megatron's count of the Mamba-2 and Gated DeltaNet layers per token (forward + backward)."""
    if config.hybrid_layer_pattern is None:
        return 0.0
    h, symbols, total = config.hidden_size, _hybrid_symbols(config), 0.0
    if "M" in symbols:
        inner, states, heads = _mamba_shape(config)
        mamba = 6 * h * (2 * inner + 2 * states + heads) + 3 * 7 * inner * config.mamba_state_dim + 6 * inner * h
        total += symbols.count("M") * mamba
    if "G" in symbols:
        qk, v, v_heads = _gdn_shape(config)
        total += symbols.count("G") * 6 * (h * (2 * qk + 2 * v + 2 * v_heads) + config.linear_conv_kernel_dim
                                           * (2 * qk + v) + 4 * v_heads * config.linear_value_head_dim ** 2 + v * h)
    return total


def _attention_layers(config: ModelConfig) -> int:
    """Layers with attention: the model's (a hybrid stack's `*` layers), and one per MTP depth."""
    if config.hybrid_layer_pattern is not None:
        return _hybrid_symbols(config).count("*")
    return config.num_layers + (config.mtp_num_layers or 0)


def flops_per_iteration(config: ModelConfig, global_batch_size: int, seq_length: int | None = None,
                        vocab_size: int | None = None, causal: bool = True,
                        squared_document_lengths: float | None = None, frozen_base: bool = False) -> float:
    """Model FLOPs of one iteration over `global_batch_size` sequences (all GPUs together);
    with `squared_document_lengths` (the sum of n^2 over the iteration's documents) the
    attention term counts packed documents, each attending within itself."""
    s = seq_length if seq_length is not None else config.seq_length
    total = global_batch_size * s * flops_per_token(config, s, vocab_size, causal, frozen_base)
    if squared_document_lengths is not None:
        total += _attention_flops(config, squared_document_lengths, causal) \
            - _attention_flops(config, global_batch_size * s * s, causal)
    return total


def _attention_flops(config: ModelConfig, squared_lengths: float, causal: bool) -> float:
    """Core attention (forward + backward) over sequences whose squared lengths sum to `squared_lengths`."""
    return 6.0 * _attention_layers(config) * _core_attention_width(config) * squared_lengths * (1 if causal else 2)

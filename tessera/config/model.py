"""ModelConfig: the architecture of a decoder-only transformer, dense or Mixture-of-Experts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessera.config.attention import check_mla, check_rope
from tessera.config.attention_windows import (
    check_attention_windows, check_gated_activation, parse_window_size, window_layers,
)
from tessera.config.fields import flag, option, positive, require
from tessera.config.hybrid import MOE as MOE_SYMBOL, apply_pattern, check_hybrid, layer_symbols
from tessera.config.moe import LOAD_BALANCING_TYPES, check_moe, parse_layer_pattern

MOE = "mixture of experts"   # the --help headings of the MoE, MLA, RoPE-scaling and MTP flags
MLA = "multi-latent attention"
ROPE_SCALING = "RoPE scaling"
MTP = "multi-token prediction"
WINDOWS = "attention sinks and sliding windows"
HYBRID = "hybrid layer pattern, Mamba-2 and Gated DeltaNet"

@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer (GPT-2/3, LLaMA, Qwen, Mistral; Mixtral, Qwen-MoE)."""

    num_layers: int = option(None, "number of transformer blocks", required=True)
    hidden_size: int = option(None, "width of the residual stream", required=True)
    ffn_hidden_size: int | None = option(None, "MLP inner width (default 4*hidden, or 8/3*hidden rounded down to 64 with --swiglu)")
    num_attention_heads: int = option(None, "attention heads", required=True)
    group_query_attention: bool = option(False, "use grouped-query attention (with --num-query-groups)")
    num_query_groups: int | None = option(None, "key/value heads under --group-query-attention")
    kv_channels: int | None = option(None, "head dimension (default hidden/heads)")
    seq_length: int = option(None, "training sequence length", required=True)
    max_position_embeddings: int | None = option(None, "size of the learned position table (default --seq-length)")
    vocab_size: int | None = option(None, "tokenizer vocabulary size (padded, see --make-vocab-size-divisible-by)")
    make_vocab_size_divisible_by: int = option(128, "pad the vocabulary to a multiple of this (times the TP size)")
    position_embedding_type: str = option("learned_absolute", "position encoding (yarn: RoPE with YaRN scaling)",
                                          ("learned_absolute", "rope", "yarn", "none"))
    rotary_base: float = option(10000.0, "RoPE base (theta)")
    rotary_percent: float = option(1.0, "fraction of each head dimension that RoPE rotates")
    normalization: str = option("LayerNorm", "normalization layer", ("LayerNorm", "RMSNorm"))
    norm_epsilon: float = option(1e-5, "epsilon of the normalization layers")
    layernorm_zero_centered_gamma: bool = option(
        False, "norm weights centred on zero: the norms scale by 1 + weight (Qwen3-Next's checkpoints; Megatron's "
        "--apply-layernorm-1p trains the same model)")
    swiglu: bool = option(False, "gated SiLU MLP (LLaMA) instead of GeLU")
    openai_gelu: bool = option(False, "tanh approximation of GeLU (GPT-2's gelu_new) instead of the exact erf form")
    squared_relu: bool = option(False, "squared ReLU MLP, relu(x)^2 (Nemotron-H), instead of GeLU")
    quick_geglu: bool = option(False, "gated quick-GELU MLP, gate * sigmoid(1.702 gate) * up (GPT-OSS), not GeLU")
    glu_linear_offset: float = option(0.0, "gated MLP: act(gate) * (up + this) (GPT-OSS 1.0)")
    activation_func_clamp_value: float | None = option(
        None, "gated MLP: clamp the gate above and up on both sides at this value before the activation (GPT-OSS 7.0)")
    disable_bias_linear: bool = option(False, "no biases in linear layers")
    add_qkv_bias: bool = option(False, "biases on the QKV projection even with --disable-bias-linear (Qwen)")
    untie_embeddings_and_output_weights: bool = option(False, "separate output layer instead of the input embedding")
    hidden_dropout: float = option(0.1, "dropout on the residual branches")
    attention_dropout: float = option(0.1, "dropout on the attention probabilities")
    init_method_std: float = option(0.02, "std of the normal initialisation (output projections are scaled by 1/sqrt(2*layers))")
    qk_layernorm: bool = option(False, "RMSNorm/LayerNorm on each head's query and key before RoPE (Qwen3); "
                                "with --multi-latent-attention, on the query and key/value latents (DeepSeek)")
    attention_output_gate: bool = option(False, "gate each attention head's output by sigmoid of a projection of "
                                         "the layer's input, per channel (Qwen3-Next)")

    # Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's flags; tessera.models.mla).
    multi_latent_attention: bool = option(
        False, "multi-latent attention: queries and keys/values through low-rank latents, RoPE on a decoupled "
        "positional part", group=MLA)
    q_lora_rank: int | None = option(None, "rank of the query latent (none: one query projection, as DeepSeek-V2-Lite)",
                                     group=MLA)
    kv_lora_rank: int | None = option(None, "rank of the key/value latent (default 32)", group=MLA)
    qk_head_dim: int | None = option(None, "query/key channels per head without position (default 128)", group=MLA)
    qk_pos_emb_head_dim: int | None = option(
        None, "query/key channels per head that carry RoPE, the key's shared by all heads (default 64)", group=MLA)
    v_head_dim: int | None = option(None, "value channels per head (default 128)", group=MLA)
    latent_norm_epsilon: float | None = option(
        None, "epsilon of the latents' norms (default --norm-epsilon; Hugging Face's DeepSeek models use 1e-6 "
        "whatever their rms_norm_eps)", group=MLA)

    # RoPE scaling for long contexts (tessera.models.rope): YaRN, or LLaMA-3.1's llama3 scaling.
    rope_type: str | None = option(None, "RoPE frequencies: rope, or yarn (YaRN) (default yarn with "
                                   "--multi-latent-attention, else rope)", ("rope", "yarn"), group=ROPE_SCALING)
    rotary_scaling_factor: float = option(1.0, "YaRN: context extension factor (DeepSeek-V3 40)", group=ROPE_SCALING)
    yarn_original_max_position_embeddings: int | None = option(
        None, "YaRN: context length before scaling (needed with --rotary-scaling-factor > 1)", group=ROPE_SCALING)
    yarn_beta_fast: float = option(32.0, "YaRN: turns in the original context above which frequencies are kept",
                                   group=ROPE_SCALING)
    yarn_beta_slow: float = option(1.0, "YaRN: turns below which frequencies are fully interpolated",
                                   group=ROPE_SCALING)
    yarn_correction_range_round_to_int: bool | None = option(
        None, "YaRN: round the correction range out to whole dimensions (default on)", group=ROPE_SCALING)
    mscale: float = option(1.0, "YaRN: cos and sin scale by mscale(s, --mscale) / mscale(s, --mscale-all-dim)",
                           group=ROPE_SCALING)
    mscale_all_dim: float = option(0.0, "YaRN: see --mscale; MLA's softmax scale is multiplied by "
                                   "mscale(s, --mscale-all-dim)^2", group=ROPE_SCALING)
    use_rope_scaling: bool = option(False, "llama3 RoPE scaling (LLaMA 3.1 and later)", group=ROPE_SCALING)
    rope_scaling_factor: float = option(8.0, "llama3 scaling: context extension factor", group=ROPE_SCALING)
    rope_scaling_low_freq_factor: float = option(
        1.0, "llama3 scaling: frequencies turning fewer times than this in the original context are interpolated",
        group=ROPE_SCALING)
    rope_scaling_high_freq_factor: float = option(
        4.0, "llama3 scaling: frequencies turning more times than this are kept", group=ROPE_SCALING)
    rope_scaling_original_max_position_embeddings: int = option(
        8192, "llama3 scaling: context length before scaling", group=ROPE_SCALING)

    # Mixture of Experts (Megatron-Core's flags; tessera.models.moe). Dense without --num-experts.
    num_experts: int | None = option(None, "routed experts per MoE layer (makes the model a MoE)", group=MOE)
    moe_ffn_hidden_size: int | None = option(None, "inner width of each routed expert (default --ffn-hidden-size)",
                                             group=MOE)
    moe_router_topk: int = option(2, "experts each token is routed to", group=MOE)
    moe_router_score_function: str = option("softmax", "router score function", ("softmax", "sigmoid"), group=MOE)
    moe_router_pre_softmax: bool = option(
        False, "softmax over all experts before the top-k (no renormalisation; Qwen2-MoE), instead of over the k chosen",
        group=MOE)
    moe_router_topk_scaling_factor: float | None = option(None, "multiply the routing weights by this (DeepSeek-V3 2.5)",
                                                          group=MOE)
    moe_router_num_groups: int | None = option(None, "expert groups for group-limited routing", group=MOE)
    moe_router_group_topk: int | None = option(None, "groups each token may use (group-limited routing)", group=MOE)
    moe_router_enable_expert_bias: bool = option(
        False, "aux-loss-free balancing: a per-expert bias on the scores used for selection (sigmoid)", group=MOE)
    moe_router_bias_update_rate: float = option(1e-3, "step of the expert bias per optimizer step", group=MOE)
    moe_router_dtype: str | None = option(None, "dtype of the router's GEMM and scores (default: the input's)",
                                          ("fp32", "fp64"), group=MOE)
    moe_router_load_balancing_type: list[str] = option(
        ["aux_loss"], "load-balancing loss(es)", LOAD_BALANCING_TYPES, group=MOE)
    moe_aux_loss_coeff: list[float] = option([0.0], "coefficient of each load-balancing loss", group=MOE)
    moe_z_loss_coeff: float | None = option(None, "coefficient of the router z-loss", group=MOE)
    moe_expert_capacity_factor: float | None = option(
        None, "tokens an expert takes, as a multiple of an even share (default: dropless)", group=MOE)
    moe_token_drop_policy: str = option("probs", "which tokens an expert over capacity keeps",
                                        ("probs", "position"), group=MOE)
    moe_pad_expert_input_to_capacity: bool = option(
        False, "give every expert exactly its capacity of rows (static shapes)", group=MOE)
    moe_shared_expert_intermediate_size: int | None = option(
        None, "inner width of the shared expert every token also goes through", group=MOE)
    moe_shared_expert_gate: bool = option(False, "scale the shared expert's output by sigmoid(x w) (Qwen2-MoE)",
                                          group=MOE)
    moe_layer_freq: str = option("1", "MoE layers: every Nth (int) or a 0/1 list expression such as "
                                 "'([0]*1+[1]*23)'", group=MOE, parse=str)
    moe_grouped_gemm: bool = option(False, "all local experts in grouped GEMMs instead of a loop over experts",
                                    group=MOE)

    # Attention sinks and sliding windows (GPT-OSS; Megatron-Core's flags; tessera.models.attention_sinks).
    softmax_type: str = option(
        "vanilla", "attention softmax: vanilla; off-by-one (a logit 0 in every denominator); learnable (a learned "
        "logit per head: attention sinks, GPT-OSS)", ("vanilla", "off-by-one", "learnable"), group=WINDOWS)
    window_size: tuple[int, int] | None = option(
        None, "sliding-window attention 'LEFT,0': a token sees itself and the LEFT tokens before it (GPT-OSS 127,0)",
        group=WINDOWS, parse=parse_window_size)
    window_attn_skip_freq: str | None = option(
        None, "with --window-size, the full-attention layers: every Nth (int; GPT-OSS 2), or a list expression of "
        "1 (window) / 0 (full) per layer", group=WINDOWS, parse=str)

    # Multi-token prediction (DeepSeek-V3; Megatron-Core's flags; tessera.models.mtp).
    mtp_num_layers: int | None = option(
        None, "multi-token prediction depths after the last layer, depth k predicting token t+k+1 at position t "
        "(each a projection of the shifted tokens' embedding and the previous hidden state, and one transformer "
        "layer)", group=MTP)
    mtp_loss_scaling_factor: float = option(
        0.1, "weight of the MTP losses: the objective adds this / --mtp-num-layers x each depth's loss", group=MTP)

    # Hybrid stacks (Megatron-Core's HybridModel flags; tessera.config.hybrid, tessera.models.hybrid).
    hybrid_layer_pattern: str | None = option(
        None, "one symbol per layer: M Mamba-2, G Gated DeltaNet, * attention, - MLP, E MoE; | marks pipeline-stage "
        "boundaries; "
        "sets --num-layers", group=HYBRID)
    hybrid_override_pattern: str | None = option(None, "deprecated spelling of --hybrid-layer-pattern", group=HYBRID)
    mamba_state_dim: int = option(128, "Mamba-2: SSM state size per head (N)", group=HYBRID)
    mamba_head_dim: int = option(64, "Mamba-2: channels per SSM head (P)", group=HYBRID)
    mamba_num_groups: int = option(8, "Mamba-2: groups of heads sharing B and C", group=HYBRID)
    mamba_num_heads: int | None = option(None, "Mamba-2: SSM heads (default 2 x hidden / --mamba-head-dim)",
                                         group=HYBRID)
    linear_num_key_heads: int = option(16, "Gated DeltaNet: query and key heads", group=HYBRID)
    linear_num_value_heads: int = option(32, "Gated DeltaNet: value and output-gate heads, a multiple of the key "
                                         "heads", group=HYBRID)
    linear_key_head_dim: int = option(128, "Gated DeltaNet: channels per query and key head", group=HYBRID)
    linear_value_head_dim: int = option(128, "Gated DeltaNet: channels per value head", group=HYBRID)
    linear_conv_kernel_dim: int = option(4, "Gated DeltaNet: width of the causal convolution on q, k and v",
                                         group=HYBRID)

    def __post_init__(self) -> None:
        apply_pattern(self)   # the pattern sets the layer count
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            require(getattr(self, name) is not None, f"{flag(name)} is required (or pick --model PRESET)")
        check_mla(self)   # before the key/value groups get their default
        require(not (self.attention_output_gate and self.multi_latent_attention),
                "--attention-output-gate does not apply to --multi-latent-attention")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.gated_linear_unit else 4 * self.hidden_size
            )
        if self.kv_channels is None:
            require(
                self.hidden_size % self.num_attention_heads == 0,
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads}), or give --kv-channels",
            )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention:
            require(
                self.num_query_groups in (None, self.num_attention_heads),
                "--num-query-groups needs --group-query-attention",
            )
            self.num_query_groups = self.num_attention_heads
        require(self.num_query_groups is not None, "--group-query-attention needs --num-query-groups")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        positive(self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings",
                  "vocab_size", "make_vocab_size_divisible_by", "norm_epsilon", "init_method_std")
        require(
            self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--num-query-groups ({self.num_query_groups})",
        )
        check_rope(self)
        if self.position_embedding_type == "learned_absolute":
            require(
                self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings ({self.max_position_embeddings}) must be at least "
                f"--seq-length ({self.seq_length})",
            )
        if self.position_embedding_type == "rope" and not self.multi_latent_attention:
            rotary_dim = self.kv_channels * self.rotary_percent
            require(
                0 < self.rotary_percent <= 1 and rotary_dim == int(rotary_dim) and int(rotary_dim) % 2 == 0,
                f"--rotary-percent ({self.rotary_percent}) x --kv-channels ({self.kv_channels}) "
                "must be a positive even number of channels",
            )
        for name in ("hidden_dropout", "attention_dropout"):
            require(0.0 <= getattr(self, name) < 1.0, f"{flag(name)} must be in [0, 1)")
        check_moe(self)
        check_attention_windows(self)
        check_gated_activation(self)
        require(not (self.squared_relu and (self.gated_linear_unit or self.openai_gelu)),
                "--squared-relu is an activation of its own: not with --swiglu, --quick-geglu or --openai-gelu")
        self._check_mtp()
        check_hybrid(self)

    def _check_mtp(self) -> None:
        positive(self, "mtp_num_layers")
        require(self.mtp_loss_scaling_factor >= 0, "--mtp-loss-scaling-factor must be >= 0")
        # As Megatron: the shifted tokens have no learned positions of their own.
        require(not self.mtp_num_layers or self.position_embedding_type != "learned_absolute",
                "--mtp-num-layers needs --position-embedding-type rope, yarn or none (not learned_absolute)")

    def moe_layers(self, with_mtp: bool = False) -> list[bool]:
        """Per layer: is it a MoE layer (all False for a dense model); `with_mtp` appends the MTP
        depths' layers, each of the last layer's kind (as Megatron builds and counts them)."""
        if self.num_experts is None:
            pattern = [False] * self.num_layers
        elif self.hybrid_layer_pattern is not None:
            pattern = [symbol == MOE_SYMBOL for symbol in layer_symbols(self.hybrid_layer_pattern)]
        else:
            pattern = parse_layer_pattern(self.moe_layer_freq, self.num_layers)
        return pattern + pattern[-1:] * (self.mtp_num_layers or 0) if with_mtp else pattern

    @property
    def last_stage_embedding(self) -> bool:
        """Whether the last pipeline stage needs the word embedding too: for a tied output layer,
        or as the MTP depths' input."""
        return self.tie_embeddings or bool(self.mtp_num_layers)

    @property
    def gated_linear_unit(self) -> bool:
        """Whether fc1 holds a gate and an up projection (--swiglu or --quick-geglu)."""
        return self.swiglu or self.quick_geglu

    def window_layers(self) -> list[int | None]:
        """Per layer, its sliding window (tokens before the query it sees), or None for full attention."""
        return window_layers(self)

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear

    @property
    def tie_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    @property
    def rotary_dim(self) -> int:
        return int(self.kv_channels * self.rotary_percent)

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Vocabulary padded so that every tensor-parallel shard is a multiple of the divisor."""
        require(self.vocab_size is not None, "--vocab-size is required (or give a tokenizer / data)")
        multiple = self.make_vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple

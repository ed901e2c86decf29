"""The attention part of ModelConfig: multi-latent attention (MLA) and RoPE scaling (YaRN,
llama3), with Megatron-LM's flag names and the checks that make them mean one thing.

Megatron spells YaRN two ways: --position-embedding-type yarn (any attention) and
--rope-type yarn (MLA, where it is the default). Both are accepted and stored one way:
position_embedding_type "rope" with rope_type "yarn". YaRN at --rotary-scaling-factor 1
is plain RoPE. Megatron silently takes an original context length of 4096 for MLA's
YaRN; tessera asks for --yarn-original-max-position-embeddings instead, since the
correction range depends on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.config.fields import flag, positive, require

if TYPE_CHECKING:
    from tessera.config.model import ModelConfig

# Megatron's command-line defaults of the MLA dimensions (_add_mla_args).
MLA_DEFAULTS = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
# Fields that only mean something with YaRN, or with llama3 scaling, and their defaults.
_YARN_ONLY = {"rotary_scaling_factor": 1.0, "yarn_original_max_position_embeddings": None, "yarn_beta_fast": 32.0,
              "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": None, "mscale": 1.0, "mscale_all_dim": 0.0}
_LLAMA3_ONLY = {"rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
                "rope_scaling_original_max_position_embeddings": 8192}
_YARN = "YaRN (--position-embedding-type yarn, or --rope-type yarn)"


def check_mla(config: "ModelConfig") -> None:
    """Validate the MLA fields (before the key/value groups get their defaults); fill the dimensions."""
    if not config.multi_latent_attention:
        for name in ("q_lora_rank", "latent_norm_epsilon", *MLA_DEFAULTS):
            require(getattr(config, name) is None, f"{flag(name)} needs --multi-latent-attention")
        return
    require(not config.group_query_attention and config.num_query_groups in (None, config.num_attention_heads),
            "--multi-latent-attention has no key/value groups: drop --group-query-attention / --num-query-groups "
            "(every head's keys and values are expanded from one shared latent)")
    for name, default in MLA_DEFAULTS.items():
        if getattr(config, name) is None:
            setattr(config, name, default)
    positive(config, "q_lora_rank", "latent_norm_epsilon", *MLA_DEFAULTS)
    # MLA sizes its heads by the three head dims; Megatron ignores --kv-channels, which its
    # launch scripts set to --qk-head-dim: another value means the dims were read differently.
    if config.kv_channels is None:
        config.kv_channels = config.qk_head_dim
    require(config.kv_channels == config.qk_head_dim,
            f"--kv-channels ({config.kv_channels}) does not add up with --multi-latent-attention: a query/key head "
            f"is --qk-head-dim + --qk-pos-emb-head-dim = {config.qk_head_dim} + {config.qk_pos_emb_head_dim} "
            f"channels and a value head --v-head-dim = {config.v_head_dim}; leave --kv-channels out, or set it to "
            f"--qk-head-dim as Megatron's scripts do")
    require(config.qk_pos_emb_head_dim % 2 == 0,
            f"--qk-pos-emb-head-dim ({config.qk_pos_emb_head_dim}) must be even: RoPE rotates pairs of channels "
            f"(a query head is --qk-head-dim + --qk-pos-emb-head-dim = {config.qk_head_dim} + "
            f"{config.qk_pos_emb_head_dim} channels, a value head --v-head-dim)")
    require(config.position_embedding_type in ("rope", "yarn"),
            "--multi-latent-attention needs --position-embedding-type rope or yarn (its positional key and "
            f"query parts are rotated), got {config.position_embedding_type}")
    require(config.rotary_percent == 1.0,
            f"--rotary-percent ({config.rotary_percent}) does not apply to --multi-latent-attention: RoPE rotates "
            "exactly the --qk-pos-emb-head-dim channels of each head")
    require(not config.add_qkv_bias, "--add-qkv-bias does not apply to --multi-latent-attention (it has no QKV "
            "projection; its projections have biases unless --disable-bias-linear)")


def check_rope(config: "ModelConfig") -> None:
    """Resolve --position-embedding-type yarn / --rope-type, and validate YaRN and llama3 scaling."""
    if config.position_embedding_type == "yarn":
        require(config.rope_type in (None, "yarn"), "--position-embedding-type yarn contradicts --rope-type rope")
        config.position_embedding_type, config.rope_type = "rope", "yarn"
    if config.position_embedding_type != "rope":
        require(config.rope_type is None, f"--rope-type needs --position-embedding-type rope (got "
                                          f"{config.position_embedding_type})")
    elif config.rope_type is None:
        config.rope_type = "yarn" if config.multi_latent_attention else "rope"   # Megatron's defaults
    if config.rope_type == "yarn":
        _check_yarn(config)
    else:
        _require_defaults(config, _YARN_ONLY, _YARN)
    if config.use_rope_scaling:
        require(config.position_embedding_type == "rope", "--use-rope-scaling needs --position-embedding-type rope")
        require(config.rope_type == "rope", "--use-rope-scaling (llama3) and YaRN are two RoPE scalings: use one "
                                            "(with --multi-latent-attention, add --rope-type rope)")
        _check_llama3(config)
    else:
        _require_defaults(config, _LLAMA3_ONLY, "--use-rope-scaling")


def _require_defaults(config: "ModelConfig", defaults: dict, needed: str) -> None:
    for name, default in defaults.items():
        require(getattr(config, name) == default, f"{flag(name)} needs {needed}")


def _check_yarn(config: "ModelConfig") -> None:
    factor, original = config.rotary_scaling_factor, config.yarn_original_max_position_embeddings
    require(factor >= 1, f"--rotary-scaling-factor ({factor}) must be at least 1 (YaRN extends the context)")
    require(factor == 1 or original is not None,
            f"--rotary-scaling-factor {factor} (YaRN) needs --yarn-original-max-position-embeddings: the context "
            "length before scaling, which sets the correction range (DeepSeek-V3: 4096)")
    positive(config, "yarn_original_max_position_embeddings")
    # Equal betas give a one-step ramp (both references allow it; Kimi-K2 uses 1 and 1).
    require(config.yarn_beta_fast >= config.yarn_beta_slow > 0,
            f"--yarn-beta-fast ({config.yarn_beta_fast}) must exceed --yarn-beta-slow ({config.yarn_beta_slow}) "
            "or equal it, and both be positive")
    require(config.mscale >= 0 and config.mscale_all_dim >= 0, "--mscale and --mscale-all-dim must be >= 0")
    if config.yarn_correction_range_round_to_int is None:
        config.yarn_correction_range_round_to_int = True


def _check_llama3(config: "ModelConfig") -> None:
    low, high = config.rope_scaling_low_freq_factor, config.rope_scaling_high_freq_factor
    require(config.rope_scaling_factor >= 1,
            f"--rope-scaling-factor ({config.rope_scaling_factor}) must be at least 1 (llama3 scaling extends "
            "the context)")
    require(0 < low < high, f"--rope-scaling-low-freq-factor ({low}) must be positive and below "
                            f"--rope-scaling-high-freq-factor ({high})")
    positive(config, "rope_scaling_original_max_position_embeddings")

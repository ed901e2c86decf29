"""What the Hugging Face families' config readers and writers share: the refusal they raise and the
fields that several families spell alike. It sits below tessera.interop.hf_config and the family
modules (hf_deepseek, hf_gpt_oss, hf_mamba, hf_nemotron_h, hf_qwen3_next), which build on it and
on nothing of each other's, so that hf_config can import them all and dispatch.

RoPE: transformers 5 writes the base and scaling inside `rope_parameters`; 4.x wrote
`rope_theta` and `rope_scaling` at the top level. Both are read (`rope_scaling` first, as
transformers 5 does). Scaling maps onto Megatron's flags: llama3 onto --use-rope-scaling and
--rope-scaling-*, yarn onto --rotary-scaling-factor, --yarn-* and --mscale / --mscale-all-dim.
HF's yarn takes its cos/sin factor as mscale / mscale_all_dim only when both are set, else
mscale(factor, 1); Megatron's formula gives the latter with --mscale 1 --mscale-all-dim 0.

Routers: Qwen's decoder_sparse_step and mlp_only_layers say which layers are MoE. DeepSeek-V3's
sigmoid router (Nemotron-H's too) renormalises the top-k by norm_topk_prob and limits the choice
to topk_group of n_group expert groups, each scored by the sum of its best two experts.
"""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig
from tessera.models.rope import Llama3Scaling, YarnScaling, rope_scaling

V3_GROUP_SCORE_EXPERTS = 2   # DeepSeek-V3's router scores an expert group by the sum of its best two


class UnsupportedModel(ValueError):
    """The HF model uses a feature tessera's GPTModel does not compute."""


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config.json of either transformers version, as one dict."""
    params = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def rope_fields_from_hf(hf: dict[str, Any], default_theta: float = 10000.0, *,
                        multi_latent_attention: bool = False) -> dict[str, Any]:
    """ModelConfig's RoPE fields (base and scaling) of an HF config.json dict.

    With multi-latent attention HF also scales the softmax by mscale(factor, mscale_all_dim)^2,
    which Megatron's formula shares with the cos/sin factor: a yarn config whose cos/sin factor
    HF computes without mscale_all_dim (mscale unset) cannot be said in tessera's flags.
    """
    params = _rope_parameters(hf)
    kind = params["rope_type"]
    fields: dict[str, Any] = {"rotary_base": float(params.get("rope_theta", hf.get("rope_theta", default_theta)))}
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                      hf.get("max_position_embeddings")))
    if kind == "llama3":
        return dict(fields, use_rope_scaling=True, rope_scaling_factor=float(params["factor"]),
                    rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                    rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                    rope_scaling_original_max_position_embeddings=int(original))
    if kind != "yarn":
        if kind != "default":
            raise UnsupportedModel(f"rope_type '{kind}' (RoPE scaling) is not supported; tessera computes "
                                   "llama3 and yarn")
        return dict(fields, rope_type="rope") if multi_latent_attention else fields
    factor = params.get("factor") or hf["max_position_embeddings"] / original   # HF's fallback
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        if multi_latent_attention and mscale_all_dim:
            raise UnsupportedModel(f"yarn mscale_all_dim {mscale_all_dim} without mscale is not supported with "
                                   "multi-latent attention (set both)")
        mscale, mscale_all_dim = 1.0, 0.0
    yarn = dict(fields, rope_type="yarn", rotary_scaling_factor=float(factor),
                yarn_original_max_position_embeddings=int(original),
                yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                yarn_beta_slow=float(params.get("beta_slow") or 1.0),
                yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
                mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))
    if params.get("attention_factor") is not None:
        expected = YarnScaling(factor, int(original), mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))
        if abs(params["attention_factor"] - expected.attention_factor) > 1e-12:
            raise UnsupportedModel(f"yarn attention_factor {params['attention_factor']} is not supported (tessera "
                                   f"derives {expected.attention_factor} from factor, mscale and mscale_all_dim)")
    return yarn


def hf_rope_parameters(model: ModelConfig) -> dict[str, Any]:
    """transformers 5's `rope_parameters` of a tessera model (with rope_theta)."""
    scaling = rope_scaling(model)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rotary_base}
    if isinstance(scaling, Llama3Scaling):
        rope.update(rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                    high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_max_positions)
    elif isinstance(scaling, YarnScaling):
        rope.update(rope_type="yarn", factor=scaling.factor,
                    original_max_position_embeddings=scaling.original_max_positions, beta_fast=scaling.beta_fast,
                    beta_slow=scaling.beta_slow, truncate=scaling.round_to_int)
        if scaling.mscale and scaling.mscale_all_dim:
            rope.update(mscale=scaling.mscale, mscale_all_dim=scaling.mscale_all_dim)
        elif (scaling.mscale, scaling.mscale_all_dim) != (1.0, 0.0):   # HF's fallback: mscale(factor, 1)
            raise UnsupportedModel(f"--mscale {scaling.mscale} with --mscale-all-dim {scaling.mscale_all_dim} has no "
                                   "Hugging Face equivalent (HF needs both nonzero, or --mscale 1 --mscale-all-dim 0)")
    return rope


def qwen_moe_layers(step: int, mlp_only_layers: list[int], num_layers: int) -> list[bool]:
    """Per layer, whether Qwen's decoder_sparse_step and mlp_only_layers make it a MoE layer."""
    if not isinstance(step, int) or step < 1:
        raise UnsupportedModel(f"decoder_sparse_step {step!r} is not supported (a positive int is needed)")
    return [(i + 1) % step == 0 and i not in mlp_only_layers for i in range(num_layers)]


def check_sigmoid_renormalisation(hf: dict[str, Any], topk: int) -> None:
    """Refuse a norm_topk_prob that Megatron's sigmoid router (which renormalises the top-k exactly
    when it picks several) would not compute."""
    if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
        raise UnsupportedModel(f"norm_topk_prob {hf.get('norm_topk_prob')} with num_experts_per_tok {topk} is not "
                               "supported: Megatron's sigmoid router renormalises exactly when it picks several")


def group_router_fields(hf: dict[str, Any], topk: int, per_group: int) -> dict[str, Any]:
    """--moe-router-num-groups and --moe-router-group-topk of HF's n_group / topk_group (none for one
    group), where HF scores a group by the sum of its best `per_group` experts and Megatron by its
    best topk // topk_group."""
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups == 1:
        return {}
    if topk // group_topk != per_group:
        raise UnsupportedModel(f"n_group {groups} / topk_group {group_topk} with num_experts_per_tok {topk} is not "
                               f"supported: HF scores a group by its best {per_group}, Megatron's router by its "
                               f"best num_experts_per_tok // topk_group = {topk // group_topk}")
    return dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk)

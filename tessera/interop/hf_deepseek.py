"""Hugging Face DeepSeek-V2 and DeepSeek-V3 (also Moonlight and Kimi-K2, which run as
DeepseekV3ForCausalLM) <-> tessera: the config fields and multi-latent attention's tensors.

The rest of a layer maps as the other MoE families' does (tessera.interop.hf): experts fused
in memory ([E, 2I, H] / [E, H, I]) and per expert on disk, the ungated `mlp.shared_experts`
(n_shared_experts x moe_intermediate_size wide), `mlp.gate.e_score_correction_bias` <->
router.expert_bias, and the multi-token prediction layers stored after the last layer.

Config (transformers' DeepseekV3Config; Megatron's MLATransformerConfig in
megatron/core/transformer/transformer_config.py), in Megatron's flags:

    q_lora_rank (null: one q_proj), kv_lora_rank      --q-lora-rank, --kv-lora-rank
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim    --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim
    q_a_layernorm, kv_a_layernorm (always there)      --qk-layernorm; their epsilon is HF's fixed 1e-6,
                                                      whatever rms_norm_eps says: --latent-norm-epsilon
    first_k_dense_replace k                           --moe-layer-freq "([0]*k+[1]*(L-k))"
    V3 router: sigmoid, score + bias for the choice,  --moe-router-score-function sigmoid
      unbiased scores renormalised over the top-k,    --moe-router-enable-expert-bias
      x routed_scaling_factor; n_group / topk_group   --moe-router-topk-scaling-factor, --moe-router-num-groups
                                                      / --moe-router-group-topk
    V2 router: softmax over all experts, top-k not    --moe-router-pre-softmax
      renormalised, x routed_scaling_factor

HF's V3 router scores a group by the sum of its best 2 experts, Megatron's by the sum of its
best topk // topk_group (the same for DeepSeek-V3's 8 // 4); V2's group_limited_greedy by its
best one (Megatron's when topk // topk_group is 1). Other group sizes are refused, and so is
what tessera would compute differently: rope_interleave false (tessera rotates DeepSeek's
interleaved pairs), attention_bias (HF biases only q_a_proj, kv_a_proj_with_mqa and o_proj;
tessera's --add-bias-linear every projection), fewer key/value heads than heads, and a
renormalisation other than Megatron's (sigmoid top-k is renormalised exactly when k > 1).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig, flag
from tessera.interop.hf_fields import V3_GROUP_SCORE_EXPERTS, UnsupportedModel, check_sigmoid_renormalisation, \
    group_router_fields, rope_fields_from_hf

# The multi-latent attention families: model_type -> architecture
ARCHITECTURES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "kimi_k2": "DeepseekV3ForCausalLM"}
V3_ROUTER = ("deepseek_v3", "kimi_k2")   # the families with DeepSeek-V3's sigmoid router and expert bias
HF_LATENT_NORM_EPSILON = 1e-6   # DeepseekV2/V3RMSNorm's default, which the latent norms are built with
# HF attention module name -> tessera's (tessera.models.mla)
_MLA_NAMES = {"q_proj": "q_proj", "q_a_proj": "q_down", "q_a_layernorm": "q_norm", "q_b_proj": "q_up",
              "kv_a_proj_with_mqa": "kv_down", "kv_a_layernorm": "kv_norm", "kv_b_proj": "kv_up", "o_proj": "proj"}
# Router fields no DeepSeek family computes, with tessera's defaults.
_ROUTER_DEFAULTS = {"moe_expert_capacity_factor": None, "moe_shared_expert_gate": False}


# -- config.json -> ModelConfig ------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], vocab_multiple: int) -> ModelConfig:
    """The tessera ModelConfig of a DeepSeek-V2/V3 config.json (the MTP depths are set by the
    checkpoint's tensors, tessera.interop.hf: HF's config defaults to one where there is none)."""
    router = _router(hf["model_type"])
    _refuse_what_tessera_computes_differently(hf)
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    eps = float(hf.get("rms_norm_eps", 1e-6))
    positions = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, seq_length=positions, max_position_embeddings=positions,
        vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=vocab_multiple,
        position_embedding_type="rope", **rope_fields_from_hf(hf, multi_latent_attention=True),
        normalization="RMSNorm", norm_epsilon=eps, swiglu=True, disable_bias_linear=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=hf.get("initializer_range", 0.02),
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        qk_layernorm=True, latent_norm_epsilon=None if eps == HF_LATENT_NORM_EPSILON else HF_LATENT_NORM_EPSILON,
        **_moe_fields(hf, router, layers),
    )


def _refuse_what_tessera_computes_differently(hf: dict[str, Any]) -> None:
    heads = hf["num_attention_heads"]
    problems = [
        (hf.get("hidden_act", "silu") != "silu", f"hidden_act '{hf.get('hidden_act')}' is not supported (SwiGLU uses silu)"),
        (hf.get("rope_interleave", True) is False,
         "rope_interleave false is not supported: tessera's MLA rotates DeepSeek's interleaved channel pairs"),
        (bool(hf.get("attention_bias")),
         "attention_bias true is not supported: HF biases q_a_proj, kv_a_proj_with_mqa and o_proj only, "
         "tessera's --add-bias-linear every projection and MLP"),
        (bool(hf.get("mlp_bias")), "mlp_bias true is not supported (tessera's experts have no biases)"),
        (hf.get("num_key_value_heads") not in (None, heads),
         f"num_key_value_heads {hf.get('num_key_value_heads')} is not supported: multi-latent attention expands "
         f"keys and values for all {heads} heads"),
        (hf.get("v_head_dim") is None, "v_head_dim null is not supported (give the value head width)"),
        (hf.get("moe_layer_freq", 1) != 1,
         f"moe_layer_freq {hf.get('moe_layer_freq')} is not supported (transformers makes every layer from "
         "first_k_dense_replace on a MoE layer)"),
    ]
    qk_head_dim = hf.get("qk_nope_head_dim", 0) + hf.get("qk_rope_head_dim", 0)
    problems.append((hf.get("qk_head_dim", qk_head_dim) != qk_head_dim,
                     f"qk_head_dim {hf.get('qk_head_dim')} does not add up: qk_nope_head_dim + qk_rope_head_dim = "
                     f"{hf.get('qk_nope_head_dim')} + {hf.get('qk_rope_head_dim')} = {qk_head_dim}"))
    for refused, message in problems:
        if refused:
            raise UnsupportedModel(message)


def _moe_fields(hf: dict[str, Any], router: str, layers: int) -> dict[str, Any]:
    """The MoE fields of ModelConfig (none when every layer is dense)."""
    dense = min(hf.get("first_k_dense_replace") or 0, layers)
    experts = hf.get("n_routed_experts")
    if experts is None or dense == layers:
        return {}
    topk, shared = hf["num_experts_per_tok"], hf.get("n_shared_experts") or 0
    if shared < 1:
        raise UnsupportedModel(f"n_shared_experts {shared} is not supported (DeepSeek's MoE layers have a shared expert)")
    scaling = float(hf.get("routed_scaling_factor", 1.0))
    fields = dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=hf["moe_intermediate_size"],
                  moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"],
                  moe_layer_freq=dense_prefix_pattern(dense, layers), moe_router_dtype="fp32",
                  moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling)
    if router == "v3":
        check_sigmoid_renormalisation(hf, topk)
        fields.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      **group_router_fields(hf, topk, V3_GROUP_SCORE_EXPERTS))
        return fields
    method = hf.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModel(f"topk_method '{method}' is not supported (DeepSeek-V2's are greedy and "
                               "group_limited_greedy)")
    fields["moe_router_pre_softmax"] = True
    if method == "group_limited_greedy":   # groups scored by their best expert; greedy ignores n_group
        fields.update(group_router_fields(hf, topk, 1))
    return fields


def _router(family: str) -> str:
    """Whose router the family computes: DeepSeek-V2's softmax one, or V3's sigmoid one (Kimi-K2's too)."""
    return "v3" if family in V3_ROUTER else "v2"


def dense_prefix_pattern(dense: int, layers: int) -> str:
    """--moe-layer-freq for `dense` dense layers then MoE ones, written as the presets write it."""
    return f"([0]*{dense}+[1]*{layers - dense})"


# -- ModelConfig -> config.json ------------------------------------------------------------

def family_of(model: ModelConfig) -> str:
    """The DeepSeek family that computes what this MLA model computes (V3's router for sigmoid
    scores or a dense model, V2's for softmax before the top-k)."""
    needs = {"normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True, "qk_layernorm": True,
             "position_embedding_type": "rope", "rotary_percent": 1.0, "use_rope_scaling": False}
    for name, value in needs.items():
        if getattr(model, name) != value:
            raise UnsupportedModel(f"a multi-latent attention model exports to DeepSeek only with {flag(name)} "
                                   f"{value} (got {getattr(model, name)})")
    latent_eps = model.latent_norm_epsilon or model.norm_epsilon
    if latent_eps != HF_LATENT_NORM_EPSILON:
        raise UnsupportedModel(f"--latent-norm-epsilon {latent_eps} has no Hugging Face equivalent: DeepSeek's "
                               f"latent norms use {HF_LATENT_NORM_EPSILON}")
    if model.num_experts is None or model.moe_router_score_function == "sigmoid":
        return "deepseek_v3"
    if model.moe_router_pre_softmax and not model.moe_router_enable_expert_bias:
        return "deepseek_v2"
    raise UnsupportedModel("this MoE model has no DeepSeek equivalent: DeepSeek-V3 routes with sigmoid scores, "
                           "DeepSeek-V2 with a softmax over all experts before the top-k (--moe-router-pre-softmax)")


def write_fields(hf: dict[str, Any], model: ModelConfig, family: str) -> None:
    """The DeepSeek fields of `model` into `hf`, which holds the Llama-like ones (and the imported config's)."""
    heads = model.num_attention_heads
    hf.update(architectures=[ARCHITECTURES[family]], num_key_value_heads=heads, q_lora_rank=model.q_lora_rank,
              kv_lora_rank=model.kv_lora_rank, qk_nope_head_dim=model.qk_head_dim,
              qk_rope_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
              qk_head_dim=model.qk_head_dim + model.qk_pos_emb_head_dim, head_dim=model.qk_pos_emb_head_dim,
              attention_bias=False)
    hf.pop("sliding_window", None)
    if _router(family) == "v3":
        hf["rope_interleave"] = True
        hf.pop("mlp_bias", None)
    # Without MTP depths of its own the model keeps the imported count (whose layers it did not hold).
    hf["num_nextn_predict_layers"] = model.mtp_num_layers or hf.get("num_nextn_predict_layers", 0)
    hf.pop("num_mtp_layers", None)   # transformers 5's alias of the same field
    moe = model.moe_layers()
    dense = moe.index(True) if any(moe) else model.num_layers
    if moe != [False] * dense + [True] * (model.num_layers - dense):
        raise UnsupportedModel(f"--moe-layer-freq {model.moe_layer_freq!r} has no DeepSeek equivalent: its dense "
                               "layers must all come first (first_k_dense_replace)")
    if model.mtp_num_layers and not any(moe):
        raise UnsupportedModel("--mtp-num-layers with a dense last layer has no DeepSeek equivalent: DeepSeek's "
                               "MTP layers are MoE layers")
    hf["first_k_dense_replace"] = dense
    if model.num_experts is not None:
        _write_router(hf, model, family)


def _write_router(hf: dict[str, Any], model: ModelConfig, family: str) -> None:
    for name, default in _ROUTER_DEFAULTS.items():
        if getattr(model, name) != default:
            raise UnsupportedModel(f"{flag(name)} has no equivalent in the DeepSeek models")
    expert_ffn, shared = model.moe_ffn_hidden_size, model.moe_shared_expert_intermediate_size or 0
    if shared == 0 or shared % expert_ffn:
        raise UnsupportedModel(f"--moe-shared-expert-intermediate-size ({shared or None}) must be a positive multiple "
                               f"of --moe-ffn-hidden-size ({expert_ffn}): DeepSeek's shared experts are "
                               "n_shared_experts routed experts wide")
    topk, groups, group_topk = model.moe_router_topk, model.moe_router_num_groups, model.moe_router_group_topk
    v3 = _router(family) == "v3"
    per_group = V3_GROUP_SCORE_EXPERTS if v3 else 1
    if groups and topk // group_topk != per_group:
        raise UnsupportedModel(f"--moe-router-topk {topk} with --moe-router-group-topk {group_topk} has no "
                               f"{family} equivalent: its router scores a group by its best {per_group}")
    hf.update(n_routed_experts=model.num_experts, num_experts_per_tok=topk, moe_intermediate_size=expert_ffn,
              n_shared_experts=shared // expert_ffn, routed_scaling_factor=model.moe_router_topk_scaling_factor or 1.0,
              n_group=groups or 1, topk_group=group_topk or 1, norm_topk_prob=v3 and topk > 1)
    if not v3:
        hf["topk_method"] = "group_limited_greedy" if groups else "greedy"


# -- tensors -------------------------------------------------------------------------------

def attention_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """MLA tensors of HF layer prefix `src` ("model.layers.3.") under tessera block prefix `dst`."""
    out = {}
    for hf_name, name in _MLA_NAMES.items():
        key = f"{src}self_attn.{hf_name}.weight"
        if key in hf:   # q_proj, or q_a_proj / q_a_layernorm / q_b_proj
            out[f"{dst}attention.{name}.weight"] = hf[key]
    return out


def attention_to_hf(state: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    out = {}
    for hf_name, name in _MLA_NAMES.items():
        key = f"{src}attention.{name}.weight"
        if key in state:
            out[f"{dst}self_attn.{hf_name}.weight"] = state[key]
    return out

"""Hugging Face Qwen3-Next (`Qwen3NextForCausalLM`, transformers' models/qwen3_next) <-> tessera.

Each HF layer is two tessera hybrid layers: its token mixer (`G` for layer_types
"linear_attention", `*` for "full_attention") and its MLP (`E` for a sparse MoE block, `-` for a
dense one, as decoder_sparse_step and mlp_only_layers say), so the 80B-A3B model's 48 layers are
--hybrid-layer-pattern "GEGEGE*E" x 12. Config, in Megatron's flags:

    linear_num_key_heads, linear_num_value_heads,    --linear-num-key-heads, --linear-num-value-heads,
    linear_key_head_dim, linear_value_head_dim,      --linear-key-head-dim, --linear-value-head-dim,
    linear_conv_kernel_dim                           --linear-conv-kernel-dim
    q_proj with a gate, o_proj(out * sigmoid(gate))  --attention-output-gate
    q_norm, k_norm (per head)                        --qk-layernorm
    RMSNorm scaling by 1 + weight                    --layernorm-zero-centered-gamma (the Gated DeltaNet's
                                                     gated norm keeps a plain weight, as in HF)
    partial_rotary_factor                            --rotary-percent
    MoE: softmax router, top-k, a sigmoid-gated      --num-experts, --moe-router-topk,
      shared expert                                  --moe-shared-expert-intermediate-size,
                                                     --moe-shared-expert-gate (as Qwen2-MoE)

Tensors: HF groups in_proj_qkvz by key head ([q, k, v, z] of each key head and its value heads)
and in_proj_ba likewise ([b, a]); tessera's in_proj holds [q, k, v, z, b, a], each part in head
order (Megatron's layout, which tensor parallelism cuts part by part). HF's q_proj gives each head
its query then its gate; tessera's qkv is [q; k; v; gate]. The rest keep their values; import and
export are exact. Multi-token prediction weights (mtp.*, which transformers skips) are not read.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tessera.config import ModelConfig, flag
from tessera.config.hybrid import ATTENTION, GATED_DELTANET, MLP, MOE, layer_symbols
from tessera.interop.hf_fields import UnsupportedModel, hf_rope_parameters, qwen_moe_layers, rope_fields_from_hf

FAMILY, ARCHITECTURE = "qwen3_next", "Qwen3NextForCausalLM"
_LINEAR, _FULL = "linear_attention", "full_attention"
# The fields of a tessera model that must hold for it to be a Qwen3-Next model.
_BLOCKS = {"normalization": "RMSNorm", "layernorm_zero_centered_gamma": True,
           "position_embedding_type": "rope", "swiglu": True, "disable_bias_linear": True, "add_qkv_bias": False,
           "qk_layernorm": True, "attention_output_gate": True, "multi_latent_attention": False,
           "softmax_type": "vanilla",
           "window_size": None, "mtp_num_layers": None, "moe_router_score_function": "softmax",
           "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
           "moe_router_enable_expert_bias": False, "moe_expert_capacity_factor": None}
# The Gated DeltaNet's fields, one name in both configs, with transformers' defaults.
_LINEAR_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_MIXER = {"conv1d.weight": "conv_weight", "dt_bias": "dt_bias", "A_log": "A_log", "norm.weight": "norm_weight",
          "out_proj.weight": "out_proj.weight"}


# -- config.json <-> ModelConfig ---------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], vocab_multiple: int) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act '{hf['hidden_act']}' is not supported (SwiGLU and the conv use silu)")
    if hf.get("attention_bias"):
        raise UnsupportedModel("attention_bias true is not supported (Qwen3-Next's projections have no biases)")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    kinds = hf.get("layer_types") or [_LINEAR if (i + 1) % hf.get("full_attention_interval", 4) else _FULL
                                      for i in range(layers)]
    unknown = set(kinds) - {_LINEAR, _FULL}
    if unknown:
        raise UnsupportedModel(f"layer_types {', '.join(sorted(unknown))} are not supported ({_LINEAR} and {_FULL})")
    experts = hf.get("num_experts", 512)
    moe = qwen_moe_layers(hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or [], layers) if experts \
        else [False] * layers
    pattern = "".join((GATED_DELTANET if kind == _LINEAR else ATTENTION) + (MOE if is_moe else MLP)
                      for kind, is_moe in zip(kinds, moe))
    rope = _rope_parameters(hf)
    positions = hf.get("max_position_embeddings", 32768)
    return ModelConfig(
        hybrid_layer_pattern=pattern, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None, kv_channels=hf.get("head_dim", 256),
        seq_length=positions, max_position_embeddings=positions, vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=vocab_multiple, position_embedding_type="rope",
        **rope_fields_from_hf({**hf, "rope_parameters": rope}), rotary_percent=float(rope["partial_rotary_factor"]),
        normalization="RMSNorm", layernorm_zero_centered_gamma=True, norm_epsilon=hf.get("rms_norm_eps", 1e-6),
        swiglu=True, disable_bias_linear=True, qk_layernorm=True, attention_output_gate=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
        **{name: hf.get(name, default) for name, default in _LINEAR_DEFAULTS.items()},
        **(_moe_fields(hf, experts) if any(moe) else {}))


def _rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters with the partial rotary factor, wherever the config keeps it (default 0.25)."""
    rope = dict(hf.get("rope_parameters") or {})
    rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    return rope


def _moe_fields(hf: dict[str, Any], experts: int) -> dict[str, Any]:
    shared = hf.get("shared_expert_intermediate_size", 512)
    if not shared:
        raise UnsupportedModel(f"shared_expert_intermediate_size {shared} is not supported (Qwen3-Next's shared "
                               "expert must have a width)")
    return dict(num_experts=experts, moe_router_topk=hf.get("num_experts_per_tok", 10),
                moe_ffn_hidden_size=hf.get("moe_intermediate_size", 512),
                moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
                moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True,
                moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.001))])


def _pairs(model: ModelConfig) -> list[tuple[str, str]]:
    """(mixer, MLP) symbols of each HF layer; one line naming why when the pattern is not such pairs."""
    symbols = layer_symbols(model.hybrid_layer_pattern)
    pairs = list(zip(symbols[0::2], symbols[1::2]))
    if len(symbols) % 2 or any(m not in (GATED_DELTANET, ATTENTION) or f not in (MLP, MOE) for m, f in pairs):
        raise UnsupportedModel(f"--hybrid-layer-pattern {model.hybrid_layer_pattern!r} has no Hugging Face "
                               "equivalent: Qwen3-Next's layers are pairs of a mixer (G or *) and an MLP (- or E)")
    return pairs


def family_of(model: ModelConfig) -> str:
    """qwen3_next for a stack of Qwen3-Next's layers; else one line naming what it lacks."""
    _pairs(model)
    for name, value in _BLOCKS.items():
        if getattr(model, name) != value:
            raise UnsupportedModel(f"{flag(name)} {getattr(model, name)} has no Hugging Face equivalent: "
                                   f"Qwen3-Next needs {value}")
    if model.num_experts is not None and not (model.moe_shared_expert_intermediate_size
                                              and model.moe_shared_expert_gate):
        raise UnsupportedModel("Qwen3-Next's MoE layers need --moe-shared-expert-intermediate-size and "
                               "--moe-shared-expert-gate")
    return FAMILY


def write_fields(hf: dict[str, Any], model: ModelConfig, aux_loss_coeff: float) -> None:
    """The Qwen3NextConfig fields of `model` into `hf` (which holds the imported config's, if any)."""
    pairs = _pairs(model)
    rope = {**hf_rope_parameters(model), "partial_rotary_factor": model.rotary_percent}
    hf.update(architectures=[ARCHITECTURE], model_type=FAMILY, num_hidden_layers=len(pairs),
              layer_types=[_LINEAR if mixer == GATED_DELTANET else _FULL for mixer, _ in pairs],
              hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
              num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
              head_dim=model.kv_channels, max_position_embeddings=model.max_position_embeddings,
              vocab_size=model.vocab_size, rms_norm_eps=model.norm_epsilon, hidden_act="silu",
              rope_parameters=rope, tie_word_embeddings=model.tie_embeddings, attention_bias=False,
              attention_dropout=model.attention_dropout,
              **{name: getattr(model, name) for name in _LINEAR_DEFAULTS}, decoder_sparse_step=1,
              mlp_only_layers=[i for i, (_, mlp) in enumerate(pairs) if mlp == MLP],
              num_experts=model.num_experts or 0)
    hf.pop("rope_scaling", None)   # transformers 5 reads rope_parameters; a stale 4.x copy would override it
    if model.num_experts is not None:
        hf.update(num_experts_per_tok=model.moe_router_topk, moe_intermediate_size=model.moe_ffn_hidden_size,
                  shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                  norm_topk_prob=not model.moe_router_pre_softmax, router_aux_loss_coef=aux_loss_coeff)


# -- tensors -------------------------------------------------------------------------------------

MoeMapping = Callable[..., dict]


def state_from_hf(hf: dict[str, torch.Tensor], model: ModelConfig, pad_rows, swiglu_from_hf, moe_from_hf: MoeMapping
                  ) -> dict[str, torch.Tensor]:
    """tessera's tensors; `swiglu_from_hf` and `moe_from_hf` map the MLPs as for the other families."""
    vocab = model.padded_vocab_size()
    out = {"embedding.weight": pad_rows(hf["model.embed_tokens.weight"], vocab),
           "final_norm.weight": hf["model.norm.weight"]}
    for i, (mixer, mlp) in enumerate(_pairs(model)):
        src, first, second = f"model.layers.{i}.", f"layers.{2 * i}.", f"layers.{2 * i + 1}."
        out[first + "input_norm.weight"] = hf[src + "input_layernorm.weight"]
        out[second + "input_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if mixer == GATED_DELTANET:
            out.update(mixer_from_hf(hf, src + "linear_attn.", first + "mixer.", model))
        else:
            out.update(_attention_from_hf(hf, src + "self_attn.", first + "attention.", model))
        if mlp == MOE:
            out.update(moe_from_hf(hf, src, second + "mlp.", model, FAMILY))
        else:
            out[second + "mlp.fc1.weight"], out[second + "mlp.fc2.weight"] = swiglu_from_hf(hf, src + "mlp.")
    if model.untie_embeddings_and_output_weights:
        out["output_weight"] = pad_rows(hf["lm_head.weight"], vocab)
    return out


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig, swiglu_to_hf, moe_to_hf: MoeMapping
                ) -> dict[str, torch.Tensor]:
    vocab = model.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.weight"][:vocab],
           "model.norm.weight": state["final_norm.weight"]}
    for i, (mixer, mlp) in enumerate(_pairs(model)):
        dst, first, second = f"model.layers.{i}.", f"layers.{2 * i}.", f"layers.{2 * i + 1}."
        out[dst + "input_layernorm.weight"] = state[first + "input_norm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[second + "input_norm.weight"]
        if mixer == GATED_DELTANET:
            out.update(mixer_to_hf(state, first + "mixer.", dst + "linear_attn.", model))
        else:
            out.update(_attention_to_hf(state, first + "attention.", dst + "self_attn.", model))
        out.update(moe_to_hf(state, second + "mlp.", dst, model, FAMILY) if mlp == MOE
                   else swiglu_to_hf(state, second + "mlp.", dst + "mlp."))
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_weight"][:vocab]
    return out


def _mixer_widths(model: ModelConfig) -> tuple[int, list[int], list[int]]:
    """(key heads, each key head's [q, k, v, z] rows in HF's in_proj_qkvz, its [b, a] rows in in_proj_ba)."""
    key_heads = model.linear_num_key_heads
    per_key = model.linear_num_value_heads // key_heads
    values = per_key * model.linear_value_head_dim
    return key_heads, [model.linear_key_head_dim] * 2 + [values] * 2, [per_key] * 2


def mixer_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    """A Gated DeltaNet's tensors: HF's per-key-head groups regrouped part by part."""
    key_heads, qkvz, ba = _mixer_widths(model)
    grouped = [hf[src + "in_proj_qkvz.weight"].unflatten(0, (key_heads, -1)).split(qkvz, dim=1),
               hf[src + "in_proj_ba.weight"].unflatten(0, (key_heads, -1)).split(ba, dim=1)]
    in_proj = torch.cat([part.flatten(0, 1) for parts in grouped for part in parts])
    return {dst + "in_proj.weight": in_proj, **{dst + name: hf[src + hf_name] for hf_name, name in _MIXER.items()}}


def mixer_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    key_heads, qkvz, ba = _mixer_widths(model)
    parts = state[src + "in_proj.weight"].split([key_heads * w for w in qkvz + ba])
    heads_first = [part.unflatten(0, (key_heads, -1)) for part in parts]
    return {dst + "in_proj_qkvz.weight": torch.cat(heads_first[:4], dim=1).flatten(0, 1),
            dst + "in_proj_ba.weight": torch.cat(heads_first[4:], dim=1).flatten(0, 1),
            **{dst + hf_name: state[src + name] for hf_name, name in _MIXER.items()}}


def _attention_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict:
    query, gate = hf[src + "q_proj.weight"].unflatten(0, (model.num_attention_heads, 2, -1)).unbind(1)
    qkv = torch.cat([query.flatten(0, 1), hf[src + "k_proj.weight"], hf[src + "v_proj.weight"], gate.flatten(0, 1)])
    return {dst + "qkv.weight": qkv, dst + "proj.weight": hf[src + "o_proj.weight"],
            dst + "q_norm.weight": hf[src + "q_norm.weight"], dst + "k_norm.weight": hf[src + "k_norm.weight"]}


def _attention_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict:
    q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
    query, key, value, gate = state[src + "qkv.weight"].split([q, kv, kv, q])
    heads = model.num_attention_heads
    q_proj = torch.stack([query.unflatten(0, (heads, -1)), gate.unflatten(0, (heads, -1))], dim=1).flatten(0, 2)
    return {dst + "q_proj.weight": q_proj, dst + "k_proj.weight": key, dst + "v_proj.weight": value,
            dst + "o_proj.weight": state[src + "proj.weight"], dst + "q_norm.weight": state[src + "q_norm.weight"],
            dst + "k_norm.weight": state[src + "k_norm.weight"]}

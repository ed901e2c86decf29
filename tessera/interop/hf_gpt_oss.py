"""Hugging Face GPT-OSS (`GptOssForCausalLM`, transformers' models/gpt_oss) <-> tessera: config and tensors.

Config, in Megatron's flags:

    attention_bias true (q, k, v, o biases)   no --disable-bias-linear: every projection, the router
                                              and the experts have biases, as in GPT-OSS
    self_attn.sinks (one logit per head)      --softmax-type learnable
    sliding_window W, layer_types             --window-size W-1,0; --window-attn-skip-freq 2 for the
                                              released alternation (sliding first), else a 0/1 list
    experts: gate = min(g, limit), up =      --quick-geglu --glu-linear-offset 1
      clamp(u, +-limit), gate * sigmoid(      --activation-func-clamp-value limit (alpha must be 1.702,
      alpha gate) * (up + 1)                  quick-GELU's)
    router: linear with bias, top-k of the    --num-experts, --moe-router-topk (softmax over the k,
      logits, softmax over the k              Megatron's default)
    rope_parameters yarn (truncate false)     --position-embedding-type yarn ... (tessera.interop.hf_fields)

Tensors: HF's experts are fused and transposed, with gate and up interleaved along the last
dimension (gate_up_proj [E, H, 2I]: gate at even columns, up at odd; down_proj [E, I, H]);
tessera's are [E, 2I, H] with [gate; up] halves and [E, H, I]. On disk they are as in memory
(transformers has no conversion for this family), so import and export are exact.
The released checkpoints quantise the experts to MXFP4 (`*_blocks`, `*_scales`): those are
refused; dequantised (bf16) copies convert.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig, flag
from tessera.interop.hf_fields import UnsupportedModel, hf_rope_parameters, rope_fields_from_hf
from tessera.models.gated_activation import QUICK_GELU_ALPHA

FAMILY, ARCHITECTURE = "gpt_oss", "GptOssForCausalLM"
_SLIDING, _FULL = "sliding_attention", "full_attention"
# The fields of a tessera model that must hold for it to be a GPT-OSS model.
_BLOCKS = {"normalization": "RMSNorm", "position_embedding_type": "rope", "disable_bias_linear": False,
           "add_qkv_bias": False, "qk_layernorm": False, "quick_geglu": True, "glu_linear_offset": 1.0,
           "softmax_type": "learnable", "rotary_percent": 1.0, "multi_latent_attention": False,
           "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
           "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None,
           "moe_router_enable_expert_bias": False, "moe_expert_capacity_factor": None,
           "moe_shared_expert_intermediate_size": None, "moe_layer_freq": "1", "mtp_num_layers": None}


# -- config.json <-> ModelConfig ---------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], vocab_multiple: int) -> ModelConfig:
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if alpha != QUICK_GELU_ALPHA:
        raise UnsupportedModel(f"swiglu_alpha {alpha} is not supported (tessera's --quick-geglu uses "
                               f"{QUICK_GELU_ALPHA})")
    if not hf.get("attention_bias", True):
        raise UnsupportedModel("attention_bias false is not supported (GPT-OSS's experts and router have biases, "
                               "and tessera biases every linear layer or none)")
    if hf.get("quantization_config"):
        raise UnsupportedModel("a quantised GPT-OSS checkpoint (MXFP4 experts) is not supported: convert a "
                               "dequantised (bf16) copy")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    groups = hf.get("num_key_value_heads") or heads
    positions = hf.get("max_position_embeddings", 131072)
    return ModelConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        seq_length=positions, max_position_embeddings=positions,
        vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=vocab_multiple,
        position_embedding_type="rope", **rope_fields_from_hf(hf, 150000.0), normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-5), quick_geglu=True, glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)), softmax_type="learnable",
        **_window_fields(hf, layers),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
        num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.001))],
    )


def _window_fields(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    kinds = hf.get("layer_types") or [_SLIDING if (i + 1) % 2 else _FULL for i in range(layers)]
    unknown = set(kinds) - {_SLIDING, _FULL}
    if unknown or len(kinds) != layers:
        raise UnsupportedModel(f"layer_types {sorted(unknown) or kinds} are not supported (one of {_SLIDING}, "
                               f"{_FULL} per layer)")
    window = hf.get("sliding_window")
    if _SLIDING not in kinds or window is None:
        return {}
    if window < 1:
        raise UnsupportedModel(f"sliding_window {window} is not supported (a positive number of tokens)")
    windowed = [kind == _SLIDING for kind in kinds]
    alternating = windowed == [(i + 1) % 2 == 1 for i in range(layers)]
    skip = "2" if alternating else ("[" + ",".join(str(int(w)) for w in windowed) + "]")
    return {"window_size": (window - 1, 0), "window_attn_skip_freq": None if all(windowed) else skip}


def check_model(model: ModelConfig) -> None:
    """Refuse, naming the flag, a tessera model that GPT-OSS's code would compute differently."""
    for name, value in _BLOCKS.items():
        if getattr(model, name) != value:
            raise UnsupportedModel(f"{flag(name)} {getattr(model, name)} has no Hugging Face equivalent: GPT-OSS "
                                   f"needs {value}")
    if model.num_experts is None or model.activation_func_clamp_value is None:
        raise UnsupportedModel("GPT-OSS needs --num-experts and --activation-func-clamp-value")


def write_fields(hf: dict[str, Any], model: ModelConfig, aux_loss_coeff: float) -> None:
    """GPT-OSS's config.json fields of `model` into `hf` (which holds the imported config's, if any)."""
    check_model(model)
    windows = model.window_layers()
    hf.update(
        architectures=[ARCHITECTURE], model_type=FAMILY, num_hidden_layers=model.num_layers,
        hidden_size=model.hidden_size, intermediate_size=model.moe_ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
        head_dim=model.kv_channels, max_position_embeddings=model.max_position_embeddings,
        vocab_size=model.vocab_size, rms_norm_eps=model.norm_epsilon, hidden_act="silu",
        rope_parameters=hf_rope_parameters(model), tie_word_embeddings=model.tie_embeddings,
        attention_dropout=model.attention_dropout, attention_bias=True, num_local_experts=model.num_experts,
        num_experts_per_tok=model.moe_router_topk, router_aux_loss_coef=aux_loss_coeff,
        swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=model.activation_func_clamp_value,
        sliding_window=model.window_size[0] + 1 if model.window_size else None,
        layer_types=[_FULL if window is None else _SLIDING for window in windows],
    )
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    hf["rope_parameters"]["rope_theta"] = model.rotary_base


# -- tensors ------------------------------------------------------------------------------------

def layer_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """Tessera's tensors of GPT-OSS layer `src` (model.layers.{i}.) as layer `dst` (layers.{i}.)."""
    attn, moe = src + "self_attn.", src + "mlp."
    out = {dst + "input_norm.weight": hf[src + "input_layernorm.weight"],
           dst + "post_attention_norm.weight": hf[src + "post_attention_layernorm.weight"],
           dst + "attention.sinks": hf[attn + "sinks"],
           dst + "mlp.router.weight": hf[moe + "router.weight"], dst + "mlp.router.bias": hf[moe + "router.bias"]}
    for kind in ("weight", "bias"):
        out[f"{dst}attention.qkv.{kind}"] = torch.cat([hf[f"{attn}{p}_proj.{kind}"] for p in "qkv"])
        out[f"{dst}attention.proj.{kind}"] = hf[f"{attn}o_proj.{kind}"]
    experts = moe + "experts."
    gate_up, gate_up_bias = hf[experts + "gate_up_proj"], hf[experts + "gate_up_proj_bias"]
    out[dst + "mlp.experts.fc1"] = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    out[dst + "mlp.experts.fc1_bias"] = torch.cat([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], dim=-1)
    out[dst + "mlp.experts.fc2"] = hf[experts + "down_proj"].transpose(1, 2)
    out[dst + "mlp.experts.fc2_bias"] = hf[experts + "down_proj_bias"]
    return out


def layer_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF's tensors of tessera layer `src` (layers.{i}.) as GPT-OSS layer `dst` (model.layers.{i}.)."""
    attn, moe = dst + "self_attn.", dst + "mlp."
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    out = {dst + "input_layernorm.weight": state[src + "input_norm.weight"],
           dst + "post_attention_layernorm.weight": state[src + "post_attention_norm.weight"],
           attn + "sinks": state[src + "attention.sinks"],
           moe + "router.weight": state[src + "mlp.router.weight"], moe + "router.bias": state[src + "mlp.router.bias"]}
    for kind in ("weight", "bias"):
        for p, part in zip("qkv", state[f"{src}attention.qkv.{kind}"].split([q, kv, kv])):
            out[f"{attn}{p}_proj.{kind}"] = part
        out[f"{attn}o_proj.{kind}"] = state[f"{src}attention.proj.{kind}"]
    experts = moe + "experts."
    out[experts + "gate_up_proj"] = _interleave(state[src + "mlp.experts.fc1"].transpose(1, 2))
    out[experts + "gate_up_proj_bias"] = _interleave(state[src + "mlp.experts.fc1_bias"])
    out[experts + "down_proj"] = state[src + "mlp.experts.fc2"].transpose(1, 2)
    out[experts + "down_proj_bias"] = state[src + "mlp.experts.fc2_bias"]
    return out


def _interleave(halves: torch.Tensor) -> torch.Tensor:
    """[..., gate | up] -> [..., g0, u0, g1, u1, ...] along the last dimension."""
    gate, up = halves.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)

"""Hugging Face Nemotron-H (`NemotronHForCausalLM`, transformers' models/nemotron_h) <-> tessera:
NVIDIA's hybrids of Mamba-2, attention, MLP and MoE layers (arXiv 2504.03624; the MoE ones are
Nemotron-3's), one tessera hybrid layer per HF layer. Config, in Megatron's flags:

    layers_block_type, or the older              --hybrid-layer-pattern: linear_attention (or mamba) M,
      hybrid_override_pattern                      full_attention (or attention) *, mlp -, moe E
    mamba_num_heads, mamba_head_dim,             --mamba-num-heads, --mamba-head-dim,
      ssm_state_size, n_groups                     --mamba-state-dim, --mamba-num-groups
    mlp_hidden_act relu2 (MLPs, experts)         --squared-relu
    num_key_value_heads, head_dim                --num-query-groups, --kv-channels
    layer_norm_epsilon (every RMSNorm)           --norm-epsilon
    MoE: DeepSeek-V3's router (sigmoid scores,   --moe-router-score-function sigmoid,
      + e_score_correction_bias for the choice,    --moe-router-enable-expert-bias,
      the top-k renormalised x routed_scaling_     --moe-router-topk-scaling-factor,
      factor), ungated experts and shared expert   --moe-shared-expert-intermediate-size

Positions: transformers' NemotronHAttention applies none (no RoPE, no position table), and neither
does tessera's model of it (--position-embedding-type none), though Megatron-LM's conversion script
for the 8B (examples/post_training/modelopt/conf/nvidia/Nemotron-H-8B-Base-8K.sh) passes RoPE flags;
its training scripts (examples/rl/model_configs/nemotron5_8b.sh) pass --position-embedding-type none.

Tensors: the embedding, the norms, the Mamba-2 mixers and the output layer as Mamba2ForCausalLM's
(tessera.interop.hf_mamba, whose backbone mapping this module hands its own layers); attention's q, k and v rows fused into qkv; the MLPs' up_proj and
down_proj are fc1 and fc2; the experts per expert on disk, as transformers writes them (its fused
[E, I, H] / [E, H, I] in memory is read too). Checkpoints name the backbone `backbone.`, transformers
`model.` in memory: both are read, `backbone.` written. Import and export are exact.

Refused naming the field: an MLP activation other than relu2, biases (use_bias, mlp_bias: tessera's
--add-bias-linear would bias attention too), a latent MoE projection (moe_latent_size), a sliding
window, tied embeddings (transformers' NemotronH keeps lm_head apart), and what hf_mamba refuses of
the mixer. Multi-token prediction weights (mtp.*, which transformers skips) are not read.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.config import ModelConfig, flag
from tessera.config.hybrid import ATTENTION, MAMBA, MLP, MOE, layer_symbols
from tessera.interop import hf_mamba
from tessera.interop.hf_fields import V3_GROUP_SCORE_EXPERTS, UnsupportedModel, check_sigmoid_renormalisation, \
    group_router_fields

FAMILY, ARCHITECTURE = "nemotron_h", "NemotronHForCausalLM"
_SYMBOLS = {"linear_attention": MAMBA, "mamba": MAMBA, "full_attention": ATTENTION, "attention": ATTENTION,
            "mlp": MLP, "moe": MOE}
_LAYER_TYPES = {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp", MOE: "moe"}
# The fields of a tessera model that must hold for it to be a Nemotron-H model.
_BLOCKS = {"normalization": "RMSNorm", "position_embedding_type": "none", "disable_bias_linear": True,
           "add_qkv_bias": False, "qk_layernorm": False, "attention_output_gate": False,
           "layernorm_zero_centered_gamma": False, "multi_latent_attention": False, "softmax_type": "vanilla",
           "window_size": None, "mtp_num_layers": None, "untie_embeddings_and_output_weights": True}
_MOE_BLOCKS = {"squared_relu": True, "moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
               "moe_shared_expert_gate": False, "moe_expert_capacity_factor": None}
_BACKBONE, _IN_MEMORY = "backbone.", "model."   # checkpoints' name of the backbone, transformers' in memory


# -- config.json <-> ModelConfig ---------------------------------------------------------------

def model_config_from_hf(hf: dict[str, Any], vocab_multiple: int) -> ModelConfig:
    _refuse_what_tessera_computes_differently(hf)
    pattern = _pattern(hf)
    heads = hf.get("num_attention_heads", 32)
    groups = hf.get("num_key_value_heads") or heads
    positions = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        hybrid_layer_pattern=pattern, hidden_size=hf["hidden_size"], ffn_hidden_size=hf.get("intermediate_size", 21504),
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None, kv_channels=hf.get("head_dim", 128),
        seq_length=positions, max_position_embeddings=positions, vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=vocab_multiple, position_embedding_type="none", normalization="RMSNorm",
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), squared_relu=True, disable_bias_linear=True,
        untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)), init_method_std=hf.get("initializer_range", 0.02),
        mamba_num_heads=hf.get("mamba_num_heads", 128), mamba_head_dim=hf.get("mamba_head_dim", 64),
        mamba_state_dim=hf.get("ssm_state_size", 128), mamba_num_groups=hf.get("n_groups", 8),
        **(_moe_fields(hf) if MOE in pattern else {}))


def _refuse_what_tessera_computes_differently(hf: dict[str, Any]) -> None:
    hf_mamba.refuse_mixer_differences(hf, activation="mamba_hidden_act")
    problems = [
        (hf.get("mlp_hidden_act", "relu2") != "relu2",
         f"mlp_hidden_act '{hf.get('mlp_hidden_act')}' is not supported (tessera's --squared-relu is relu2)"),
        (bool(hf.get("use_bias") or hf.get("mlp_bias")),
         "use_bias / mlp_bias true are not supported: HF biases the mixers' or MLPs' projections only, tessera's "
         "--add-bias-linear every projection"),
        (hf.get("moe_latent_size") is not None, f"moe_latent_size {hf.get('moe_latent_size')} is not supported "
                                                "(tessera's experts read the hidden state itself)"),
        (hf.get("sliding_window") is not None, f"sliding_window {hf.get('sliding_window')} is not supported "
                                               "(set it to null)"),
        (bool(hf.get("tie_word_embeddings")), "tie_word_embeddings true is not supported: transformers' NemotronH "
                                              "keeps lm_head apart from the embedding"),
    ]
    for refused, message in problems:
        if refused:
            raise UnsupportedModel(message)


def _pattern(hf: dict[str, Any]) -> str:
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise UnsupportedModel("layers_block_type (or hybrid_override_pattern) is needed: the kind of each layer")
        kinds = list(pattern)
    unknown = sorted({kind for kind in kinds if kind not in _SYMBOLS and kind not in _LAYER_TYPES})
    if unknown:
        raise UnsupportedModel(f"layers_block_type {', '.join(map(str, unknown))} are not supported "
                               f"({', '.join(_LAYER_TYPES.values())})")
    return "".join(_SYMBOLS.get(kind, kind) for kind in kinds)


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    topk, scaling = hf.get("num_experts_per_tok", 2), float(hf.get("routed_scaling_factor", 1.0))
    check_sigmoid_renormalisation(hf, topk)
    return dict(num_experts=hf.get("n_routed_experts", 8), moe_router_topk=topk,
                moe_ffn_hidden_size=hf.get("moe_intermediate_size", 7688),
                moe_shared_expert_intermediate_size=hf.get("moe_shared_expert_intermediate_size", 7688),
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_dtype="fp32",
                moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                **group_router_fields(hf, topk, V3_GROUP_SCORE_EXPERTS))


def family_of(model: ModelConfig) -> str:
    """nemotron_h for a stack of Nemotron-H's layers; else one line naming the flag it lacks."""
    symbols = set(layer_symbols(model.hybrid_layer_pattern))
    unknown = symbols - set(_LAYER_TYPES)
    if unknown:
        raise UnsupportedModel(f"--hybrid-layer-pattern {model.hybrid_layer_pattern!r} has no Hugging Face "
                               f"equivalent: Nemotron-H's layers are M, *, - and E (not {' '.join(sorted(unknown))})")
    needs = dict(_BLOCKS)
    if symbols & {MLP, MOE}:
        needs["squared_relu"] = True
    if MOE in symbols:
        needs.update(_MOE_BLOCKS)
    for name, value in needs.items():
        if getattr(model, name) != value:
            raise UnsupportedModel(f"{flag(name)} {getattr(model, name)} has no Hugging Face equivalent: Nemotron-H "
                                   f"needs {value}")
    if MOE in symbols and not model.moe_shared_expert_intermediate_size:
        raise UnsupportedModel("Nemotron-H's MoE layers need --moe-shared-expert-intermediate-size")
    if model.moe_router_num_groups and model.moe_router_topk // model.moe_router_group_topk != V3_GROUP_SCORE_EXPERTS:
        raise UnsupportedModel(f"--moe-router-group-topk {model.moe_router_group_topk} with --moe-router-topk "
                               f"{model.moe_router_topk} has no Hugging Face equivalent: Nemotron-H scores a group by "
                               f"its best {V3_GROUP_SCORE_EXPERTS} experts")
    return FAMILY


def write_fields(hf: dict[str, Any], model: ModelConfig) -> None:
    """The NemotronHConfig fields of `model` into `hf` (which holds the imported config's, if any)."""
    family_of(model)
    pattern = "".join(layer_symbols(model.hybrid_layer_pattern))
    hf.update(architectures=[ARCHITECTURE], model_type=FAMILY,
              layers_block_type=[_LAYER_TYPES[symbol] for symbol in pattern], hidden_size=model.hidden_size,
              intermediate_size=model.ffn_hidden_size, num_attention_heads=model.num_attention_heads,
              num_key_value_heads=model.num_query_groups, head_dim=model.kv_channels,
              max_position_embeddings=model.max_position_embeddings, vocab_size=model.vocab_size,
              layer_norm_epsilon=model.norm_epsilon, mlp_hidden_act="relu2", mamba_hidden_act="silu",
              use_bias=False, mlp_bias=False, attention_bias=False, attention_dropout=model.attention_dropout,
              tie_word_embeddings=False, sliding_window=None, mamba_num_heads=model.mamba_num_heads,
              mamba_head_dim=model.mamba_head_dim, ssm_state_size=model.mamba_state_dim,
              n_groups=model.mamba_num_groups, use_conv_bias=True)
    hf.pop("num_hidden_layers", None)   # older configs' count; transformers counts layers_block_type
    if "hybrid_override_pattern" in hf:   # the older spelling, kept in step for the code that reads it
        hf["hybrid_override_pattern"] = pattern
    hf.setdefault("time_step_limit", [0.0, float("inf")])
    if model.num_experts is not None:
        hf.update(n_routed_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                  moe_intermediate_size=model.moe_ffn_hidden_size,
                  moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                  routed_scaling_factor=model.moe_router_topk_scaling_factor or 1.0,
                  n_group=model.moe_router_num_groups or 1, topk_group=model.moe_router_group_topk or 1,
                  norm_topk_prob=model.moe_router_topk > 1, moe_latent_size=None)


# -- tensors: the backbone is tessera.interop.hf_mamba's, its layers' bodies are these ------------

def state_from_hf(hf: dict[str, torch.Tensor], model: ModelConfig, pad_rows) -> dict[str, torch.Tensor]:
    hf = {_BACKBONE + name.removeprefix(_IN_MEMORY) if name.startswith(_IN_MEMORY) else name: tensor
          for name, tensor in hf.items()}
    return hf_mamba.state_from_hf(hf, model, pad_rows, layer_from_hf)


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    return hf_mamba.state_to_hf(state, model, layer_to_hf)


def layer_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, symbol: str, model: ModelConfig) -> dict:
    """Layer `dst`'s tensors (but its norm) from HF's mixer module `src`, whatever the layer's kind."""
    if symbol == MAMBA:
        return hf_mamba.mixer_from_hf(hf, src, dst, symbol, model)
    if symbol == ATTENTION:
        return {dst + "attention.qkv.weight": torch.cat([hf[f"{src}{p}_proj.weight"] for p in "qkv"]),
                dst + "attention.proj.weight": hf[src + "o_proj.weight"]}
    if symbol == MLP:
        return _mlp_from_hf(hf, src, dst + "mlp.")
    if src + "experts.up_proj" in hf:   # fused, as transformers holds them in memory
        fc1, fc2 = hf[src + "experts.up_proj"], hf[src + "experts.down_proj"]
    else:
        experts = [f"{src}experts.{j}." for j in range(model.num_experts)]
        fc1 = torch.stack([hf[e + "up_proj.weight"] for e in experts])
        fc2 = torch.stack([hf[e + "down_proj.weight"] for e in experts])
    return {dst + "mlp.router.weight": hf[src + "gate.weight"],
            dst + "mlp.router.expert_bias": hf[src + "gate.e_score_correction_bias"],
            dst + "mlp.experts.fc1": fc1, dst + "mlp.experts.fc2": fc2,
            **_mlp_from_hf(hf, src + "shared_experts.", dst + "mlp.shared_expert.")}


def layer_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, symbol: str, model: ModelConfig) -> dict:
    """HF's mixer module `dst` of layer `src`, whatever the layer's kind (experts per expert, as on disk)."""
    if symbol == MAMBA:
        return hf_mamba.mixer_to_hf(state, src, dst, symbol, model)
    if symbol == ATTENTION:
        q, kv = model.num_attention_heads * model.kv_channels, model.num_query_groups * model.kv_channels
        parts = state[src + "attention.qkv.weight"].split([q, kv, kv])
        return {**{f"{dst}{p}_proj.weight": part for p, part in zip("qkv", parts)},
                dst + "o_proj.weight": state[src + "attention.proj.weight"]}
    if symbol == MLP:
        return _mlp_to_hf(state, src + "mlp.", dst)
    router = state[src + "mlp.router.weight"]
    bias = state.get(src + "mlp.router.expert_bias")   # zeros: selection on the unbiased scores, as tessera's
    out = {dst + "gate.weight": router,
           dst + "gate.e_score_correction_bias": bias if bias is not None else router.new_zeros(model.num_experts)}
    for j, (fc1, fc2) in enumerate(zip(state[src + "mlp.experts.fc1"], state[src + "mlp.experts.fc2"])):
        out[f"{dst}experts.{j}.up_proj.weight"], out[f"{dst}experts.{j}.down_proj.weight"] = fc1, fc2
    return {**out, **_mlp_to_hf(state, src + "mlp.shared_expert.", dst + "shared_experts.")}


def _mlp_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str) -> dict:
    return {dst + "fc1.weight": hf[src + "up_proj.weight"], dst + "fc2.weight": hf[src + "down_proj.weight"]}


def _mlp_to_hf(state: dict[str, torch.Tensor], src: str, dst: str) -> dict:
    return {dst + "up_proj.weight": state[src + "fc1.weight"], dst + "down_proj.weight": state[src + "fc2.weight"]}

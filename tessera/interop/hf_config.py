"""Hugging Face config.json <-> tessera ModelConfig, for the families tessera can run exactly.

Families: Llama (2, 3), Mistral (without a sliding window), Qwen2/2.5 (QKV bias), GPT-2,
and three Mixture-of-Experts families: Mixtral, Qwen2-MoE (also Qwen1.5-MoE: QKV bias, a
sigmoid-gated shared expert) and Qwen3-MoE (per-head QK norm), whose fields are here; the
others each have a module of their own, which this one imports and dispatches to: DeepSeek-V2
and -V3 (and Kimi-K2's checkpoints, DeepSeek-V3's code) with multi-latent attention in
tessera.interop.hf_deepseek; Mamba-2 (a hybrid stack of M layers) in tessera.interop.hf_mamba;
Nemotron-H (Mamba-2, attention, MLP and MoE layers) in tessera.interop.hf_nemotron_h; Qwen3-Next
(Gated DeltaNet and gated attention) in tessera.interop.hf_qwen3_next; GPT-OSS (attention sinks,
sliding windows, biased experts) in tessera.interop.hf_gpt_oss. What they share (the refusal,
RoPE's fields) is tessera.interop.hf_fields'. Anything the tessera model would compute
differently (a RoPE scaling other than llama3 or yarn, a sliding window, biases tessera has no
place for, another activation, router jitter) is refused with a message naming the HF field,
rather than converted into a model that silently disagrees.

RoPE is written both as transformers 5's `rope_parameters` and as 4.x's top-level `rope_theta`
and `rope_scaling`, so either version loads the export.

Routers (transformers' MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock): HF's softmax over all experts, top-k,
renormalise (Mixtral; Qwen's norm_topk_prob true) is Megatron's default top-k then
softmax over the k; norm_topk_prob false is --moe-router-pre-softmax. Qwen decides which
layers are MoE by decoder_sparse_step ((i + 1) % step == 0) and mlp_only_layers, which
--moe-layer-freq's int form (i % N == 0) cannot say, so it becomes an explicit list.
"""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig, flag
from tessera.config.hybrid import GATED_DELTANET, MAMBA, layer_symbols
from tessera.config.moe import aux_loss_coefficients
from tessera.interop import hf_deepseek, hf_gpt_oss, hf_mamba, hf_nemotron_h, hf_qwen3_next
from tessera.interop.hf_fields import UnsupportedModel, hf_rope_parameters, qwen_moe_layers, rope_fields_from_hf

LLAMA_LIKE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The families whose config fields a module of their own reads: model_type -> module
_FAMILY_MODULES = {**dict.fromkeys(hf_deepseek.ARCHITECTURES, hf_deepseek),
                   **{module.FAMILY: module for module in (hf_mamba, hf_nemotron_h, hf_qwen3_next, hf_gpt_oss)}}
FAMILIES = (*LLAMA_LIKE, *_FAMILY_MODULES, "gpt2")
_GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # -> openai_gelu
_QKV_BIAS = ("qwen2", "qwen2_moe")
# Families whose sliding window is off unless use_sliding_window says otherwise.
_WINDOW_SWITCHED = ("qwen2", "qwen2_moe", "qwen3_moe")
# transformers' class defaults where a family's differ from the common ones.
_DEFAULTS = {"mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5}}
# The blocks of each kind of family, as ModelConfig fields (refused naming the first that differs).
_GPT2_BLOCKS = {"normalization": "LayerNorm", "swiglu": False, "disable_bias_linear": False, "add_qkv_bias": False,
                "qk_layernorm": False, "untie_embeddings_and_output_weights": False, "num_experts": None}
_ROPE_BLOCKS = {"normalization": "RMSNorm", "swiglu": True, "disable_bias_linear": True, "rotary_percent": 1.0}
# Router features of tessera that none of the HF MoE families computes.
_ROUTER_DEFAULTS = {"moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
                    "moe_router_num_groups": None, "moe_router_enable_expert_bias": False,
                    "moe_expert_capacity_factor": None}

# rope_parameters keys that say how RoPE is scaled: rewritten on export from tessera's fields.
_ROPE_SCALING_KEYS = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                      "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                      "truncate", "attention_factor")


def model_config_from_hf(hf: dict[str, Any], *, vocab_multiple: int = 128) -> ModelConfig:
    """The tessera ModelConfig of an HF config.json dict.

    `vocab_multiple` is --make-vocab-size-divisible-by: 1 keeps the HF vocabulary exactly
    (scoring); Megatron's 128 pads it for fast, tensor-parallel training.
    """
    family = hf.get("model_type")
    if family == "gpt2":
        return _gpt2_config(hf, vocab_multiple)
    if family in _FAMILY_MODULES:
        return _FAMILY_MODULES[family].model_config_from_hf(hf, vocab_multiple)
    if family not in LLAMA_LIKE:
        raise UnsupportedModel(f"model_type '{family}' is not supported; tessera converts {', '.join(FAMILIES)}")
    defaults = _DEFAULTS.get(family, {})
    rope = rope_fields_from_hf(hf, defaults.get("rope_theta", 10000.0))
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act '{hf['hidden_act']}' is not supported (SwiGLU uses silu)")
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise UnsupportedModel("attention_bias / mlp_bias are not supported (only Qwen2's QKV bias is)")
    _check_full_attention(hf, family)
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    positions = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups if groups != heads else None,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        seq_length=positions, max_position_embeddings=positions,
        vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=vocab_multiple,
        position_embedding_type="rope", **rope, normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)), swiglu=True,
        disable_bias_linear=True, add_qkv_bias=family in _QKV_BIAS and hf.get("qkv_bias", True),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
        **(_moe_config(hf, family) if family in MOE_FAMILIES else {}),
    )


def _check_full_attention(hf: dict[str, Any], family: str) -> None:
    window = hf.get("sliding_window")
    if family in _WINDOW_SWITCHED:
        if hf.get("use_sliding_window"):
            raise UnsupportedModel(f"use_sliding_window (sliding_window {window}) is not supported (set it to false)")
    elif window is not None:
        raise UnsupportedModel(f"sliding_window {window} is not supported (set it to null)")
    kinds = set(hf.get("layer_types") or ()) - {"full_attention"}
    if kinds:
        raise UnsupportedModel(f"layer_types {', '.join(sorted(kinds))} are not supported (only full_attention)")


def _moe_config(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The MoE fields of ModelConfig for a Mixtral, Qwen2-MoE or Qwen3-MoE config."""
    layers = hf["num_hidden_layers"]
    if family == "mixtral":
        if hf.get("router_jitter_noise"):
            raise UnsupportedModel(f"router_jitter_noise {hf['router_jitter_noise']} is not supported (set it to 0)")
        expert_ffn, pre_softmax, moe_layers = hf["intermediate_size"], False, [True] * layers
    else:
        expert_ffn, pre_softmax = hf["moe_intermediate_size"], not hf.get("norm_topk_prob", False)
        moe_layers = qwen_moe_layers(hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or [], layers)
    fields = dict(
        num_experts=_num_experts(hf), moe_router_topk=hf["num_experts_per_tok"], moe_ffn_hidden_size=expert_ffn,
        moe_router_pre_softmax=pre_softmax, moe_layer_freq=layer_freq(moe_layers),
        # HF adds one loss pooled over all layers (k x Megatron's per-layer value at balance);
        # Megatron sums one loss per layer: the same coefficient weighs balance differently.
        moe_aux_loss_coeff=[float(hf.get("router_aux_loss_coef", 0.001))],
    )
    if family == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 5632)
        if not shared:
            raise UnsupportedModel(f"shared_expert_intermediate_size {shared} is not supported (Qwen2-MoE's "
                                   "shared expert must have a width)")
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    if family == "qwen3_moe":
        fields["qk_layernorm"] = True
    return fields


def _num_experts(hf: dict[str, Any]) -> int:
    # Mixtral's field is num_local_experts, Qwen's num_experts; transformers 5.24 reads
    # Mixtral's and Qwen3-MoE's under either name and writes Qwen3-MoE's as num_local_experts.
    counts = {hf[key] for key in ("num_experts", "num_local_experts") if hf.get(key) is not None}
    if len(counts) != 1:
        raise UnsupportedModel(f"num_experts / num_local_experts must give one number of experts, got {counts or None}")
    (experts,) = counts
    if experts < 1:
        raise UnsupportedModel(f"num_experts {experts} is not supported (a MoE model needs experts)")
    return experts


def layer_freq(moe_layers: list[bool]) -> str:
    """--moe-layer-freq of a per-layer pattern: "1" when every layer is MoE (the presets' value,
    so a preset run can load the import), else an explicit list such as "[1,0,1]"."""
    if all(moe_layers):
        return "1"
    return "[" + ",".join(str(int(moe)) for moe in moe_layers) + "]"


def _gpt2_config(hf: dict[str, Any], vocab_multiple: int) -> ModelConfig:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise UnsupportedModel(f"activation_function '{activation}' is not supported")
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(name):
            raise UnsupportedModel(f"{name} is not supported")
    if hf.get("scale_attn_weights") is False:
        raise UnsupportedModel("scale_attn_weights false is not supported")
    hidden = hf["n_embd"]
    return ModelConfig(
        num_layers=hf["n_layer"], hidden_size=hidden, ffn_hidden_size=hf.get("n_inner") or 4 * hidden,
        num_attention_heads=hf["n_head"], seq_length=hf["n_positions"], max_position_embeddings=hf["n_positions"],
        vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=vocab_multiple,
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        norm_epsilon=hf.get("layer_norm_epsilon", 1e-5), openai_gelu=_GPT2_ACTIVATIONS[activation],
        hidden_dropout=float(hf.get("resid_pdrop", 0.1)), attention_dropout=float(hf.get("attn_pdrop", 0.1)),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def infer_family(model: ModelConfig) -> str:
    """The HF family that computes what this tessera config computes; else one line naming the
    feature that none of them has."""
    if model.hybrid_layer_pattern is not None:
        symbols = set(layer_symbols(model.hybrid_layer_pattern))
        if GATED_DELTANET in symbols:
            return hf_qwen3_next.family_of(model)
        if symbols == {MAMBA}:
            return hf_mamba.family_of(model)
        return hf_nemotron_h.family_of(model)   # Mamba-2 layers among others
    if model.multi_latent_attention:
        return hf_deepseek.family_of(model)
    if model.softmax_type != "vanilla" or model.quick_geglu or model.window_size is not None:
        hf_gpt_oss.check_model(model)
        return hf_gpt_oss.FAMILY
    if model.position_embedding_type == "learned_absolute":
        _require(model, _GPT2_BLOCKS, "GPT-2, the family with learned positions,")
        return "gpt2"
    if model.position_embedding_type != "rope":
        raise UnsupportedModel(f"--position-embedding-type {model.position_embedding_type} has no Hugging Face "
                               "equivalent among the families tessera converts (GPT-2 learns positions, the others "
                               "use rope)")
    _require(model, _ROPE_BLOCKS, "the RoPE families (Llama, Mistral, Qwen, Mixtral)")
    if model.num_experts is not None:
        return _moe_family(model)
    if model.qk_layernorm:
        raise UnsupportedModel("--qk-layernorm in a dense model has no Hugging Face equivalent among the families "
                               "tessera converts (Llama, Mistral and Qwen2 have no QK norm)")
    return "qwen2" if model.add_qkv_bias else "llama"


def _require(model: ModelConfig, needs: dict[str, Any], families: str) -> None:
    for name, value in needs.items():
        if getattr(model, name) != value:
            raise UnsupportedModel(f"{flag(name)} {getattr(model, name)} has no Hugging Face equivalent: {families} "
                                   f"need {value}")


def _moe_family(model: ModelConfig) -> str:
    """The HF MoE family whose router, shared expert and attention this MoE config has; else one
    line naming the feature none of them has."""
    for name, default in _ROUTER_DEFAULTS.items():
        if getattr(model, name) != default:
            raise UnsupportedModel(f"{flag(name)} has no equivalent in the Hugging Face MoE families")
    if model.moe_shared_expert_intermediate_size is not None:
        if not model.moe_shared_expert_gate:
            raise UnsupportedModel("--moe-shared-expert-intermediate-size without --moe-shared-expert-gate has no "
                                   "Hugging Face equivalent without multi-latent attention: Qwen2-MoE, the family "
                                   "with a shared expert, gates it (DeepSeek's ungated ones come with MLA)")
        if model.qk_layernorm:
            raise UnsupportedModel("--qk-layernorm with a shared expert has no Hugging Face equivalent: Qwen2-MoE, "
                                   "the family with a shared expert, has no QK norm")
        return "qwen2_moe"
    if model.add_qkv_bias:
        raise UnsupportedModel("--add-qkv-bias in a MoE model without a shared expert has no Hugging Face "
                               "equivalent: Mixtral and Qwen3-MoE have no QKV bias")
    if model.qk_layernorm:
        return "qwen3_moe"
    if model.moe_router_pre_softmax:
        raise UnsupportedModel("--moe-router-pre-softmax without --qk-layernorm has no Hugging Face equivalent: "
                               "Mixtral renormalises the top-k (Qwen3-MoE, which may not, has QK norm)")
    if not all(model.moe_layers()):
        raise UnsupportedModel(f"--moe-layer-freq {model.moe_layer_freq!r} (dense layers) without --qk-layernorm has "
                               "no Hugging Face equivalent: Mixtral's layers are all MoE (Qwen3-MoE, which has "
                               "dense layers, has QK norm)")
    return "mixtral"


def hf_config_from_model(model: ModelConfig, family: str, base: dict[str, Any] | None = None,
                         dtype: str = "float32") -> dict[str, Any]:
    """config.json for `model` as `family`; fields of `base` (the imported config) are kept
    where tessera has no opinion (token ids, tokenizer class, ...)."""
    if family not in FAMILIES:
        raise UnsupportedModel(f"unknown family '{family}'; choose one of {', '.join(FAMILIES)}")
    same = ({"llama", "mistral"}, {"deepseek_v3", "kimi_k2"})   # one computation, two names
    inferred = infer_family(model)
    if family != inferred and {family, inferred} not in same:
        raise UnsupportedModel(f"this model is a {inferred} model, not {family}")
    hf = dict(base or {})
    if base is not None and base.get("model_type") != family:
        hf = {}  # another family's fields would not mean the same thing
    if family == hf_mamba.FAMILY:
        hf_mamba.write_fields(hf, model)
    elif family == hf_nemotron_h.FAMILY:
        hf_nemotron_h.write_fields(hf, model)
    elif family == hf_qwen3_next.FAMILY:
        hf_qwen3_next.write_fields(hf, model, float(sum(aux_loss_coefficients(model).values())))
    elif family == "gpt2":
        hf.update(
            architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=model.num_layers,
            n_embd=model.hidden_size, n_head=model.num_attention_heads, n_positions=model.max_position_embeddings,
            n_inner=model.ffn_hidden_size, vocab_size=model.vocab_size, layer_norm_epsilon=model.norm_epsilon,
            activation_function="gelu_new" if model.openai_gelu else "gelu", tie_word_embeddings=True,
            resid_pdrop=model.hidden_dropout, embd_pdrop=model.hidden_dropout, attn_pdrop=model.attention_dropout,
        )
    elif family == hf_gpt_oss.FAMILY:
        hf_gpt_oss.write_fields(hf, model, float(sum(aux_loss_coefficients(model).values())))
    else:
        rope = hf_rope_parameters(model)
        # The imported config's other RoPE keys (none of them scaling ones) are kept.
        rope = {**{k: v for k, v in (hf.get("rope_parameters") or {}).items() if k not in _ROPE_SCALING_KEYS}, **rope}
        hf.update(
            architectures=[LLAMA_LIKE.get(family)], model_type=family, num_hidden_layers=model.num_layers,
            hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
            head_dim=model.kv_channels, max_position_embeddings=model.max_position_embeddings,
            vocab_size=model.vocab_size, rms_norm_eps=model.norm_epsilon, hidden_act="silu",
            rope_theta=model.rotary_base, rope_parameters=rope, tie_word_embeddings=model.tie_embeddings,
            rope_scaling=({k: v for k, v in rope.items() if k != "rope_theta"} if rope["rope_type"] != "default"
                          else None),
            attention_dropout=model.attention_dropout,
        )
        if family not in _QKV_BIAS:
            hf.update(attention_bias=False, mlp_bias=False)
        if family != "llama":
            hf.setdefault("sliding_window", None)
        if family in MOE_FAMILIES:
            _write_moe_fields(hf, model, family)
        if family in hf_deepseek.ARCHITECTURES:
            hf_deepseek.write_fields(hf, model, family)
    hf["initializer_range"] = model.init_method_std
    hf["dtype"] = hf["torch_dtype"] = dtype
    return hf


def _write_moe_fields(hf: dict[str, Any], model: ModelConfig, family: str) -> None:
    """The MoE fields of `family` into `hf` (which holds the imported config's, if any)."""
    for alias in ("num_experts", "num_local_experts"):   # transformers versions write either
        if alias in hf:
            hf[alias] = model.num_experts
    # HF has one load-balancing weight: that of whichever kinds tessera trains with (float: HF's configs are strict)
    hf.update(num_experts_per_tok=model.moe_router_topk,
              router_aux_loss_coef=float(sum(aux_loss_coefficients(model).values())))
    if family == "mixtral":
        hf.update(num_local_experts=model.num_experts, intermediate_size=model.moe_ffn_hidden_size,
                  router_jitter_noise=0.0)
        return
    moe_layers = model.moe_layers()
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1 or qwen_moe_layers(step, dense, model.num_layers) != moe_layers:
        step, dense = 1, [i for i, moe in enumerate(moe_layers) if not moe]
    hf.update(num_experts=model.num_experts, moe_intermediate_size=model.moe_ffn_hidden_size,
              norm_topk_prob=not model.moe_router_pre_softmax, decoder_sparse_step=step, mlp_only_layers=dense,
              use_sliding_window=False)
    if family == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
                  qkv_bias=model.add_qkv_bias, layer_types=["full_attention"] * model.num_layers)

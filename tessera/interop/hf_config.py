"""Hugging Face config.json <-> tessera ModelConfig, for the families tessera can run exactly.

Families: Llama (2, 3), Mistral (without a sliding window), Qwen2/2.5 (QKV bias) and
GPT-2. Anything the tessera model would compute differently (RoPE scaling, a sliding
window, biases tessera has no place for, another activation) is refused with a message
naming the HF field, rather than converted into a model that silently disagrees.

transformers 5 writes the RoPE base inside `rope_parameters`; 4.x wrote `rope_theta` at
the top level. Both are read, and both are written so either version loads the export.
"""

from __future__ import annotations

from typing import Any

from tessera.config import ModelConfig

LLAMA_LIKE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
FAMILIES = (*LLAMA_LIKE, "gpt2")
_GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # -> openai_gelu


class UnsupportedModel(ValueError):
    """The HF model uses a feature tessera's GPTModel does not compute."""


def _rope(hf: dict[str, Any]) -> tuple[float, str]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), kind


def model_config_from_hf(hf: dict[str, Any], *, vocab_multiple: int = 128) -> ModelConfig:
    """The tessera ModelConfig of an HF config.json dict.

    `vocab_multiple` is --make-vocab-size-divisible-by: 1 keeps the HF vocabulary exactly
    (scoring); Megatron's 128 pads it for fast, tensor-parallel training.
    """
    family = hf.get("model_type")
    if family == "gpt2":
        return _gpt2_config(hf, vocab_multiple)
    if family not in LLAMA_LIKE:
        raise UnsupportedModel(f"model_type '{family}' is not supported; tessera converts {', '.join(FAMILIES)}")
    theta, rope_type = _rope(hf)
    if rope_type != "default":
        raise UnsupportedModel(f"rope_type '{rope_type}' (RoPE scaling) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act '{hf['hidden_act']}' is not supported (SwiGLU uses silu)")
    if hf.get("mlp_bias") or hf.get("attention_bias"):
        raise UnsupportedModel("attention_bias / mlp_bias are not supported (only Qwen2's QKV bias is)")
    window = hf.get("sliding_window")
    if window is not None and (family != "qwen2" or hf.get("use_sliding_window")):
        raise UnsupportedModel(f"sliding_window {window} is not supported (set it to null)")
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
        position_embedding_type="rope", rotary_base=theta, normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, disable_bias_linear=True,
        add_qkv_bias=family == "qwen2", untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
    )


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
    """The HF family that computes what this tessera config computes."""
    if model.position_embedding_type == "learned_absolute" and model.normalization == "LayerNorm" \
            and not model.swiglu and model.add_bias_linear:
        return "gpt2"
    if model.position_embedding_type == "rope" and model.normalization == "RMSNorm" and model.swiglu \
            and model.disable_bias_linear and model.rotary_percent == 1.0:
        return "qwen2" if model.add_qkv_bias else "llama"
    raise UnsupportedModel("this tessera model has no Hugging Face equivalent among " + ", ".join(FAMILIES))


def hf_config_from_model(model: ModelConfig, family: str, base: dict[str, Any] | None = None,
                         dtype: str = "float32") -> dict[str, Any]:
    """config.json for `model` as `family`; fields of `base` (the imported config) are kept
    where tessera has no opinion (token ids, tokenizer class, ...)."""
    if family not in FAMILIES:
        raise UnsupportedModel(f"unknown family '{family}'; choose one of {', '.join(FAMILIES)}")
    if family != infer_family(model) and {family, infer_family(model)} != {"llama", "mistral"}:
        raise UnsupportedModel(f"this model is a {infer_family(model)} model, not {family}")
    hf = dict(base or {})
    if base is not None and base.get("model_type") != family:
        hf = {}  # another family's fields would not mean the same thing
    if family == "gpt2":
        hf.update(
            architectures=["GPT2LMHeadModel"], model_type="gpt2", n_layer=model.num_layers,
            n_embd=model.hidden_size, n_head=model.num_attention_heads, n_positions=model.max_position_embeddings,
            n_inner=model.ffn_hidden_size, vocab_size=model.vocab_size, layer_norm_epsilon=model.norm_epsilon,
            activation_function="gelu_new" if model.openai_gelu else "gelu", tie_word_embeddings=True,
            resid_pdrop=model.hidden_dropout, embd_pdrop=model.hidden_dropout, attn_pdrop=model.attention_dropout,
        )
    else:
        rope = dict(hf.get("rope_parameters") or {}, rope_type="default", rope_theta=model.rotary_base)
        hf.update(
            architectures=[LLAMA_LIKE[family]], model_type=family, num_hidden_layers=model.num_layers,
            hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
            head_dim=model.kv_channels, max_position_embeddings=model.max_position_embeddings,
            vocab_size=model.vocab_size, rms_norm_eps=model.norm_epsilon, hidden_act="silu",
            rope_theta=model.rotary_base, rope_parameters=rope, tie_word_embeddings=model.tie_embeddings,
            attention_dropout=model.attention_dropout,
        )
        if family != "qwen2":
            hf.update(attention_bias=False, mlp_bias=False)
        if family != "llama":
            hf.setdefault("sliding_window", None)
    hf["initializer_range"] = model.init_method_std
    hf["dtype"] = hf["torch_dtype"] = dtype
    return hf

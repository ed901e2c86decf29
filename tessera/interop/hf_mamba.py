"""Hugging Face Mamba-2 (`Mamba2ForCausalLM`) <-> tessera: a hybrid stack of Mamba-2 layers only
(--hybrid-layer-pattern "MMM..."), the config fields and the tensors. Nemotron-H
(`NemotronHForCausalLM`, tessera.interop.hf_nemotron_h) builds on this module: it shares the
backbone's tensor names and the mixer's, and maps its other layers through the backbone mapping's
`layer_from_hf` / `layer_to_hf` arguments, so this module knows nothing of it.

    num_heads, head_dim, state_size, n_groups       --mamba-num-heads, --mamba-head-dim,
                                                    --mamba-state-dim, --mamba-num-groups
    num_hidden_layers                               --hybrid-layer-pattern of as many M
    layer_norm_epsilon (every RMSNorm, gated too)   --norm-epsilon
    use_bias (in_proj and out_proj)                 not --disable-bias-linear
    tie_word_embeddings                             not --untie-embeddings-and-output-weights

    backbone.embeddings.weight                      embedding.weight (vocabulary padded)
    backbone.layers.{i}.norm.weight                 layers.{i}.input_norm.weight
    backbone.layers.{i}.mixer.conv1d.{weight,bias}  layers.{i}.mixer.conv_{weight,bias}
    backbone.layers.{i}.mixer.norm.weight           layers.{i}.mixer.norm_weight
    backbone.layers.{i}.mixer.{in_proj, out_proj, dt_bias, A_log, D}   the same names
    backbone.norm_f.weight, lm_head.weight          final_norm.weight, output_weight

What tessera computes differently is refused naming the field: a conv kernel other than 4, no
conv bias, an activation other than silu, a time-step clamp other than (0, inf). chunk_size
only changes rounding (the scan is exact in any chunking), so it is not carried.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tessera.config import ModelConfig
from tessera.config.hybrid import MAMBA, layer_symbols
from tessera.interop.hf_fields import UnsupportedModel
from tessera.models.mamba import CONV_KERNEL

FAMILY, ARCHITECTURE = "mamba2", "Mamba2ForCausalLM"
_MIXER = {"in_proj.weight": "in_proj.weight", "in_proj.bias": "in_proj.bias", "conv1d.weight": "conv_weight",
          "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
          "norm.weight": "norm_weight", "out_proj.weight": "out_proj.weight", "out_proj.bias": "out_proj.bias"}
_SEQ_LENGTH = 4096   # Mamba-2 has no position table; a training length to start from
# (hf, src, dst, symbol, model) -> the tessera tensors (or, to HF, HF's) of one layer's body
LayerMapping = Callable[[dict[str, torch.Tensor], str, str, str, ModelConfig], dict[str, torch.Tensor]]


def model_config_from_hf(hf: dict[str, Any], vocab_multiple: int) -> ModelConfig:
    refuse_mixer_differences(hf)
    hidden, heads, head_dim = hf["hidden_size"], hf["num_heads"], hf["head_dim"]
    if hf.get("expand", 2) * hidden != heads * head_dim:
        raise UnsupportedModel(f"expand x hidden_size ({hf.get('expand', 2)} x {hidden}) must equal num_heads x "
                               f"head_dim ({heads} x {head_dim})")
    return ModelConfig(
        hybrid_layer_pattern=MAMBA * hf["num_hidden_layers"], hidden_size=hidden,
        # Attention's flags are required but unused: heads of the SSM's shape keep any TP split valid.
        num_attention_heads=heads, kv_channels=head_dim, seq_length=_SEQ_LENGTH,
        mamba_num_heads=heads, mamba_head_dim=head_dim, mamba_state_dim=hf["state_size"],
        mamba_num_groups=hf["n_groups"], vocab_size=hf["vocab_size"], make_vocab_size_divisible_by=vocab_multiple,
        position_embedding_type="none", normalization="RMSNorm", norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        disable_bias_linear=not hf.get("use_bias", False),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=hf.get("initializer_range", 0.02))


def refuse_mixer_differences(hf: dict[str, Any], activation: str = "hidden_act") -> None:
    """One line naming the config field (`activation` the mixer's) whose mixer tessera's would not compute."""
    if hf.get("conv_kernel", CONV_KERNEL) != CONV_KERNEL:
        raise UnsupportedModel(f"conv_kernel {hf['conv_kernel']} is not supported (tessera's conv is "
                               f"{CONV_KERNEL} wide)")
    if not hf.get("use_conv_bias", True):
        raise UnsupportedModel("use_conv_bias false is not supported (tessera's conv has a bias)")
    if hf.get(activation, "silu") != "silu":
        raise UnsupportedModel(f"{activation} '{hf[activation]}' is not supported (the mixer uses silu)")
    # transformers writes infinity into config.json as {"__float__": "Infinity"}
    limit = [float(v["__float__"] if isinstance(v, dict) else v)
             for v in hf.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        raise UnsupportedModel(f"time_step_limit {limit} is not supported (tessera does not clamp the time step)")


def family_of(model: ModelConfig) -> str:
    """mamba2 for a stack of Mamba-2 layers only (hf_config sends the others to Nemotron-H); else
    one line naming what Mamba-2 lacks."""
    if model.normalization != "RMSNorm":
        raise UnsupportedModel("--normalization LayerNorm has no Hugging Face equivalent: Mamba-2 uses RMSNorm")
    return FAMILY


def write_fields(hf: dict[str, Any], model: ModelConfig) -> None:
    """The Mamba2Config fields of `model` into `hf` (which holds the imported config's, if any)."""
    hf.update(architectures=[ARCHITECTURE], model_type=FAMILY, num_hidden_layers=model.num_layers,
              hidden_size=model.hidden_size, num_heads=model.mamba_num_heads, head_dim=model.mamba_head_dim,
              expand=model.mamba_num_heads * model.mamba_head_dim // model.hidden_size,
              state_size=model.mamba_state_dim, n_groups=model.mamba_num_groups, conv_kernel=CONV_KERNEL,
              use_conv_bias=True, use_bias=model.add_bias_linear, hidden_act="silu", vocab_size=model.vocab_size,
              layer_norm_epsilon=model.norm_epsilon, tie_word_embeddings=model.tie_embeddings)
    hf.setdefault("time_step_limit", [0.0, float("inf")])   # the imported one's spelling, when there is one


def state_from_hf(hf: dict[str, torch.Tensor], model: ModelConfig, pad_rows,
                  layer_from_hf: LayerMapping | None = None) -> dict[str, torch.Tensor]:
    """tessera's tensors of a backbone whose layers' bodies `layer_from_hf` maps (Mamba-2's mixers by default)."""
    layer_from_hf = layer_from_hf or mixer_from_hf
    vocab = model.padded_vocab_size()
    out = {"embedding.weight": pad_rows(hf["backbone.embeddings.weight"], vocab),
           "final_norm.weight": hf["backbone.norm_f.weight"]}
    for i, symbol in enumerate(layer_symbols(model.hybrid_layer_pattern)):
        src, dst = f"backbone.layers.{i}.", f"layers.{i}."
        out[dst + "input_norm.weight"] = hf[src + "norm.weight"]
        out.update(layer_from_hf(hf, src + "mixer.", dst, symbol, model))
    if model.untie_embeddings_and_output_weights:
        out["output_weight"] = pad_rows(hf["lm_head.weight"], vocab)
    return out


def state_to_hf(state: dict[str, torch.Tensor], model: ModelConfig,
                layer_to_hf: LayerMapping | None = None) -> dict[str, torch.Tensor]:
    """HF's tensors of a backbone whose layers' bodies `layer_to_hf` maps (Mamba-2's mixers by default)."""
    layer_to_hf = layer_to_hf or mixer_to_hf
    vocab = model.vocab_size
    out = {"backbone.embeddings.weight": state["embedding.weight"][:vocab],
           "backbone.norm_f.weight": state["final_norm.weight"]}
    for i, symbol in enumerate(layer_symbols(model.hybrid_layer_pattern)):
        src, dst = f"layers.{i}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = state[src + "input_norm.weight"]
        out.update(layer_to_hf(state, src, dst + "mixer.", symbol, model))
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_weight"][:vocab]
    return out


def mixer_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, symbol: str, model: ModelConfig) -> dict:
    """A Mamba-2 mixer's tensors (HF module `src`) under tessera layer `dst`."""
    return {f"{dst}mixer.{name}": hf[src + hf_name] for hf_name, name in _MIXER.items() if src + hf_name in hf}


def mixer_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, symbol: str, model: ModelConfig) -> dict:
    return {dst + hf_name: state[f"{src}mixer.{name}"] for hf_name, name in _MIXER.items()
            if f"{src}mixer.{name}" in state}

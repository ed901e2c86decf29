"""Hugging Face checkpoints <-> tessera: weights renamed, fused and transposed exactly.

    model = load_hf("path/to/hf_dir")          # single-process GPTModel; model(input_ids) -> logits
    hf_config, tensors = read_hf_dir("hf_dir")  # config.json and every tensor
    state = tessera_state_from_hf(hf_config, tensors, hf_model_config(hf_config, tensors, 128))

Whole directories (an HF model <-> a tessera checkpoint) convert one floor up, in
tessera.interop.hf_checkpoint: tessera's checkpoint reader reads a LoRA run's HF base through this
module, so this module imports nothing of tessera's checkpoints.

Tessera fuses what HF keeps apart: q, k and v rows into one `qkv` weight and Llama's
gate and up projections into `fc1` ([gate; up], the order tessera's SwiGLU chunks in).
GPT-2 stores linear weights as Conv1D ([in, out]); tessera as nn.Linear ([out, in]).
MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek) are stacked per layer, fc1 [E, 2I, H]
and fc2 [E, H, I]: import reads the per-expert files of every checkpoint and transformers 5's
fused in-memory layout alike; export writes the per-expert layout transformers writes.
Qwen3-Next's hybrid layers (Gated DeltaNet, gated attention) map in tessera.interop.hf_qwen3_next.
DeepSeek's multi-latent attention maps in tessera.interop.hf_deepseek; its expert bias
(e_score_correction_bias, kept fp32 as transformers keeps it) is the router's, and its
multi-token prediction layers (model.layers.{num_hidden_layers + d - 1}, which transformers'
model skips on load) are tessera's MTP depths, the shared embedding and output layer written
back as the copies the checkpoints hold. GPT-OSS's layers (sinks, interleaved biased experts, a
router bias) map in tessera.interop.hf_gpt_oss.
The vocabulary is padded for tensor parallelism on import (zero rows, never a target)
and cut back on export, so HF -> tessera -> HF gives back every tensor bit for bit.
Only local directories are read: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from tessera.config import ModelConfig
from tessera.interop import hf_deepseek, hf_gpt_oss, hf_mamba, hf_nemotron_h, hf_qwen3_next
from tessera.interop.hf_config import model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel

_SAFETENSORS_INDEX = "model.safetensors.index.json"
# GPT-2 block modules: (Hugging Face name, tessera name); both directions use these.
_GPT2_NORMS = (("ln_1", "input_norm"), ("ln_2", "post_attention_norm"))
_GPT2_LINEARS = (("attn.c_attn", "attention.qkv"), ("attn.c_proj", "attention.proj"),
                 ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2"))  # Conv1D weights are [in, out]
# MoE layers on disk, per expert: (module of the layer's MoE block, gate, up, down projection).
# transformers 5 fuses the experts in memory (mlp.experts.gate_up_proj [E, 2I, H] = [gate; up],
# mlp.experts.down_proj [E, H, I]) and writes these names back unless save_original_format=False.
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe.", "w1", "w3", "w2"),
                 **dict.fromkeys(("qwen2_moe", "qwen3_moe", "qwen3_next", "deepseek_v2", "deepseek_v3",
                                  "kimi_k2"),
                                 ("mlp.", "gate_proj", "up_proj", "down_proj"))}
# The shared expert's module in each family that has one (Qwen2-MoE's and Qwen3-Next's are gated).
_SHARED_EXPERTS = {"qwen2_moe": "mlp.shared_expert.", "qwen3_next": "mlp.shared_expert.",
                   **dict.fromkeys(("deepseek_v2", "deepseek_v3", "kimi_k2"), "mlp.shared_experts.")}
_EXPERT_BIAS = "gate.e_score_correction_bias"


# -- reading and writing HF directories ---------------------------------------------


def read_hf_dir(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, every tensor) of a local HF model directory (safetensors)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (a local Hugging Face model directory is needed)")
    config = json.loads((path / "config.json").read_text())
    if (path / _SAFETENSORS_INDEX).is_file():
        files = sorted(set(json.loads((path / _SAFETENSORS_INDEX).read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    return config, tensors


def write_hf_dir(path: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                 max_shard_bytes: int = 5 * 2**30) -> None:
    """config.json and safetensors files of at most `max_shard_bytes` each (with an index)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata=metadata)
    else:
        weight_map = {}
        for index, shard in enumerate(shards, 1):
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, path / name, metadata=metadata)
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / _SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                           "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# -- tensor mapping -------------------------------------------------------------------

def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def tessera_state_from_hf(hf_config: dict, hf: dict[str, torch.Tensor], model: ModelConfig,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full (unsharded) tessera parameters from HF tensors."""
    vocab = model.padded_vocab_size()
    out: dict[str, torch.Tensor] = {}
    if hf_config["model_type"] == hf_mamba.FAMILY:
        out = hf_mamba.state_from_hf(hf, model, _pad_rows)
    elif hf_config["model_type"] == hf_nemotron_h.FAMILY:
        out = hf_nemotron_h.state_from_hf(hf, model, _pad_rows)
    elif hf_config["model_type"] == hf_qwen3_next.FAMILY:
        out = hf_qwen3_next.state_from_hf(hf, model, _pad_rows, _swiglu_from_hf, _moe_from_hf)
    elif hf_config["model_type"] == "gpt2":
        hf = {name.removeprefix("transformer."): t for name, t in hf.items()}
        out["embedding.weight"] = _pad_rows(hf["wte.weight"], vocab)
        out["position_embedding.weight"] = hf["wpe.weight"]
        for i in range(model.num_layers):
            src, dst = f"h.{i}.", f"layers.{i}."
            for hf_name, name in _GPT2_NORMS:
                for kind in ("weight", "bias"):
                    out[f"{dst}{name}.{kind}"] = hf[f"{src}{hf_name}.{kind}"]
            for hf_name, name in _GPT2_LINEARS:
                out[f"{dst}{name}.weight"] = hf[f"{src}{hf_name}.weight"].t()  # Conv1D is [in, out]
                out[f"{dst}{name}.bias"] = hf[f"{src}{hf_name}.bias"]
        out["final_norm.weight"], out["final_norm.bias"] = hf["ln_f.weight"], hf["ln_f.bias"]
    else:
        out["embedding.weight"] = _pad_rows(hf["model.embed_tokens.weight"], vocab)
        for i, moe in enumerate(model.moe_layers(with_mtp=True)):
            src, dst = f"model.layers.{i}.", f"layers.{i}." if i < model.num_layers else _mtp_prefix(model, i)
            out.update(_block_from_hf(hf, src, dst, model, hf_config["model_type"], moe))
            if i >= model.num_layers:
                out.update(_mtp_from_hf(hf, src, dst))
        out["final_norm.weight"] = hf["model.norm.weight"]
        if model.untie_embeddings_and_output_weights:
            out["output_weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    return {name: t.to(dtype).contiguous() for name, t in out.items()}


def hf_state_from_tessera(state: dict[str, torch.Tensor], model: ModelConfig, family: str,
                          dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HF tensors (names of `family`) from full tessera parameters."""
    vocab = model.vocab_size
    out: dict[str, torch.Tensor] = {}
    if family == hf_mamba.FAMILY:
        out = hf_mamba.state_to_hf(state, model)
    elif family == hf_nemotron_h.FAMILY:
        out = hf_nemotron_h.state_to_hf(state, model)
    elif family == hf_qwen3_next.FAMILY:
        out = hf_qwen3_next.state_to_hf(state, model, _swiglu_to_hf, _moe_to_hf)
    elif family == "gpt2":
        out["transformer.wte.weight"] = state["embedding.weight"][:vocab]
        out["transformer.wpe.weight"] = state["position_embedding.weight"]
        for i in range(model.num_layers):
            src, dst = f"layers.{i}.", f"transformer.h.{i}."
            for hf_name, name in _GPT2_NORMS:
                for kind in ("weight", "bias"):
                    out[f"{dst}{hf_name}.{kind}"] = state[f"{src}{name}.{kind}"]
            for hf_name, name in _GPT2_LINEARS:
                out[f"{dst}{hf_name}.weight"] = state[f"{src}{name}.weight"].t()
                out[f"{dst}{hf_name}.bias"] = state[f"{src}{name}.bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = state["final_norm.weight"], state["final_norm.bias"]
    else:
        out["model.embed_tokens.weight"] = state["embedding.weight"][:vocab]
        head = state["output_weight" if model.untie_embeddings_and_output_weights else "embedding.weight"][:vocab]
        for i, moe in enumerate(model.moe_layers(with_mtp=True)):
            src, dst = f"layers.{i}." if i < model.num_layers else _mtp_prefix(model, i), f"model.layers.{i}."
            out.update(_block_to_hf(state, src, dst, model, family, moe))
            if i >= model.num_layers:
                out.update(_mtp_to_hf(state, src, dst, out["model.embed_tokens.weight"], head))
        out["model.norm.weight"] = state["final_norm.weight"]
        if model.untie_embeddings_and_output_weights:
            out["lm_head.weight"] = head
    return {name: t.to(torch.float32 if name.endswith(_EXPERT_BIAS) else dtype).contiguous()
            for name, t in out.items()}


# -- one Llama-like layer, and the multi-token prediction depths around one ------------------

def _block_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig, family: str,
                   moe: bool) -> dict:
    if family == hf_gpt_oss.FAMILY:
        return hf_gpt_oss.layer_from_hf(hf, src, dst)
    out = _attention_from_hf(hf, src, dst, model)
    if moe:
        out.update(_moe_from_hf(hf, src, dst + "mlp.", model, family))
    else:
        out[dst + "mlp.fc1.weight"], out[dst + "mlp.fc2.weight"] = _swiglu_from_hf(hf, src + "mlp.")
    return out


def _block_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig, family: str,
                 moe: bool) -> dict:
    if family == hf_gpt_oss.FAMILY:
        return hf_gpt_oss.layer_to_hf(state, src, dst, model)
    out = _attention_to_hf(state, src, dst, model)
    out.update(_moe_to_hf(state, src + "mlp.", dst, model, family) if moe
               else _swiglu_to_hf(state, src + "mlp.", dst + "mlp."))
    return out


def _mtp_prefix(model: ModelConfig, index: int) -> str:
    """tessera's prefix of the transformer layer of the MTP depth stored as HF layer `index`."""
    return f"mtp.layers.{index - model.num_layers}.layer."


# An MTP depth's own modules: HF (model.layers.L.) -> tessera (mtp.layers.{d-1}.), beside its layer.
_MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
              "shared_head.norm.weight": "final_norm.weight"}


def _mtp_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str) -> dict:
    depth = dst.removesuffix("layer.")
    head = "lm_head.weight" if "lm_head.weight" in hf else "model.embed_tokens.weight"   # tied: one matrix
    for copy, shared in (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", head)):
        if src + copy in hf and not torch.equal(hf[src + copy], hf[shared]):
            raise UnsupportedModel(f"{src}{copy} differs from {shared}: tessera's MTP depths share the main model's")
    return {depth + name: hf[src + hf_name] for hf_name, name in _MTP_NAMES.items()}


def _mtp_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, embedding: torch.Tensor,
               head: torch.Tensor) -> dict:
    depth = src.removesuffix("layer.")
    out = {dst + hf_name: state[depth + name] for hf_name, name in _MTP_NAMES.items()}
    out[dst + "embed_tokens.weight"], out[dst + "shared_head.head.weight"] = embedding.clone(), head.clone()
    return out


def hf_model_config(hf_config: dict, tensors: dict[str, torch.Tensor], vocab_multiple: int) -> ModelConfig:
    """The ModelConfig of an HF checkpoint, with the multi-token prediction depths it holds after
    its last layer: the tensors decide, since HF's DeepSeek config says num_nextn_predict_layers 1
    by default. `vocab_multiple` is model_config_from_hf's."""
    config = model_config_from_hf(hf_config, vocab_multiple=vocab_multiple)
    depths = 0
    while f"model.layers.{hf_config.get('num_hidden_layers', 0) + depths}.eh_proj.weight" in tensors:
        depths += 1
    return dataclasses.replace(config, mtp_num_layers=depths) if depths else config


# -- attention, dense MLP, MoE ---------------------------------------------------------------

def _attention_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict:
    attn = src + "self_attn."
    out = {dst + "input_norm.weight": hf[src + "input_layernorm.weight"],
           dst + "post_attention_norm.weight": hf[src + "post_attention_layernorm.weight"]}
    if model.multi_latent_attention:
        return {**out, **hf_deepseek.attention_from_hf(hf, src, dst)}
    out.update({dst + "attention.qkv.weight": torch.cat([hf[f"{attn}{p}_proj.weight"] for p in "qkv"]),
                dst + "attention.proj.weight": hf[attn + "o_proj.weight"]})
    if model.add_qkv_bias:
        out[dst + "attention.qkv.bias"] = torch.cat([hf[f"{attn}{p}_proj.bias"] for p in "qkv"])
    if model.qk_layernorm:
        for p in "qk":
            out[f"{dst}attention.{p}_norm.weight"] = hf[f"{attn}{p}_norm.weight"]
    return out


def _attention_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig) -> dict:
    attn = dst + "self_attn."
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    out = {dst + "input_layernorm.weight": state[src + "input_norm.weight"],
           dst + "post_attention_layernorm.weight": state[src + "post_attention_norm.weight"]}
    if model.multi_latent_attention:
        return {**out, **hf_deepseek.attention_to_hf(state, src, dst)}
    out[attn + "o_proj.weight"] = state[src + "attention.proj.weight"]
    for p, part in zip("qkv", state[src + "attention.qkv.weight"].split([q, kv, kv])):
        out[f"{attn}{p}_proj.weight"] = part
    if model.add_qkv_bias:
        for p, part in zip("qkv", state[src + "attention.qkv.bias"].split([q, kv, kv])):
            out[f"{attn}{p}_proj.bias"] = part
    if model.qk_layernorm:
        for p in "qk":
            out[f"{attn}{p}_norm.weight"] = state[f"{src}attention.{p}_norm.weight"]
    return out


def _swiglu_from_hf(hf: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 = [gate; up], fc2) of the gate/up/down_proj MLP at `prefix`."""
    fc1 = torch.cat([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]])
    return fc1, hf[prefix + "down_proj.weight"]


def _swiglu_to_hf(state: dict[str, torch.Tensor], src: str, dst: str) -> dict:
    gate, up = state[src + "fc1.weight"].chunk(2)
    return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up,
            dst + "down_proj.weight": state[src + "fc2.weight"]}


def _moe_from_hf(hf: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig, family: str) -> dict:
    """Router, stacked experts and shared expert of MoE layer `src`, in either HF layout."""
    prefix, gate, up, down = _EXPERT_NAMES[family]
    if src + "mlp.experts.gate_up_proj" in hf:   # fused as in memory: already tessera's [E, 2I, H] / [E, H, I]
        prefix = "mlp."
        fc1, fc2 = hf[src + "mlp.experts.gate_up_proj"], hf[src + "mlp.experts.down_proj"]
    else:
        experts = [f"{src}{prefix}experts.{j}." for j in range(model.num_experts)]
        fc1 = torch.stack([torch.cat([hf[f"{e}{gate}.weight"], hf[f"{e}{up}.weight"]]) for e in experts])
        fc2 = torch.stack([hf[f"{e}{down}.weight"] for e in experts])
    out = {dst + "router.weight": hf[f"{src}{prefix}gate.weight"], dst + "experts.fc1": fc1, dst + "experts.fc2": fc2}
    if model.moe_router_enable_expert_bias:
        out[dst + "router.expert_bias"] = hf[f"{src}{prefix}{_EXPERT_BIAS}"]
    if model.moe_shared_expert_intermediate_size:
        shared = _swiglu_from_hf(hf, src + _SHARED_EXPERTS[family])
        out[dst + "shared_expert.fc1.weight"], out[dst + "shared_expert.fc2.weight"] = shared
    if model.moe_shared_expert_gate:
        out[dst + "shared_expert_gate"] = hf[src + "mlp.shared_expert_gate.weight"]
    return out


def _moe_to_hf(state: dict[str, torch.Tensor], src: str, dst: str, model: ModelConfig, family: str) -> dict:
    """The per-expert layout transformers writes by default (and loads into its fused experts)."""
    prefix, gate, up, down = _EXPERT_NAMES[family]
    out = {f"{dst}{prefix}gate.weight": state[src + "router.weight"]}
    if family in hf_deepseek.V3_ROUTER:   # always there: zeros when tessera selects on unbiased scores
        bias = state.get(src + "router.expert_bias")
        out[f"{dst}{prefix}{_EXPERT_BIAS}"] = bias if bias is not None else state[src + "router.weight"].new_zeros(
            model.num_experts)
    for j, (fc1, fc2) in enumerate(zip(state[src + "experts.fc1"], state[src + "experts.fc2"])):
        expert = f"{dst}{prefix}experts.{j}."
        out[f"{expert}{gate}.weight"], out[f"{expert}{up}.weight"] = fc1.chunk(2)
        out[f"{expert}{down}.weight"] = fc2
    if model.moe_shared_expert_intermediate_size:
        out.update(_swiglu_to_hf(state, src + "shared_expert.", dst + _SHARED_EXPERTS[family]))
    if model.moe_shared_expert_gate:
        out[dst + "mlp.shared_expert_gate.weight"] = state[src + "shared_expert_gate"]
    return out


# -- a model to run ---------------------------------------------------------------------

def load_hf(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A single-process tessera GPTModel (eval mode) with the weights of a local HF model;
    `model(input_ids)` gives logits over exactly the HF vocabulary."""
    from tessera.models.gpt import GPTModel

    hf_config, tensors = read_hf_dir(path)
    config = hf_model_config(hf_config, tensors, vocab_multiple=1)
    with torch.device(device):
        model = GPTModel(config)
    model.load_state_dict(tessera_state_from_hf(hf_config, tensors, config), strict=True)
    return model.to(dtype).eval()

"""LoRA adapters <-> Hugging Face PEFT adapter directories, for the HF model that
`tessera convert tessera-to-hf` writes of the base.

    export_peft(model, "adapter_dir", base_model_name_or_path="hf_dir")   # a LoRA model (one process)
    paths = import_peft(model, "adapter_dir")                             # adapters onto any TP rank / stage
    write_peft_adapter("adapter_dir", tensors, config, scale=..., dropout=...)   # from a checkpoint's tensors
    adapter = read_peft_adapter("adapter_dir", config)                    # full tensors by tessera name
    tensors, sections = peft_checkpoint_state("adapter_dir", config)      # `tessera convert hf-to-tessera`

A PEFT directory holds adapter_config.json (LoraConfig's fields) and adapter_model.safetensors,
whose keys are `base_model.model.<HF module>.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r] (PEFT's save_pretrained; the adapter name left out). tessera fuses what HF keeps apart
(tessera.interop.hf): q, k and v rows in one `qkv`, gate and up rows in one `fc1`. A fused
layer's adapter is exported as one adapter per HF module, A repeated and B cut into the HF
modules' rows, which computes exactly what the fused one does; importing puts them back together,
bit for bit. Separate adapters of the pieces (PEFT's own, with A's of their own, or on some of
the pieces only: q_proj and v_proj, say) are imported exactly as one block-diagonal adapter of
their summed rank: A the pieces' A's stacked, B each piece's B in its own rows and columns.

tessera adapters share one scale (alpha / r). PEFT's per-module ranks and alphas (rank_pattern,
alpha_pattern) and rsLoRA's alpha / sqrt(r) are read by folding each module's scale into its B;
an adapter whose rank differs from the rest is written with rank_pattern and alpha_pattern.
Covered: the attention and MLP projections of the Llama-like families (and Qwen2-MoE's shared
expert); routed experts, multi-latent attention and GPT-2 are refused with one line.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.interop.hf import _SHARED_EXPERTS
from tessera.interop.hf_config import LLAMA_LIKE, infer_family
from tessera.interop.hf_fields import UnsupportedModel
from tessera.posttrain.lora import adapter_state, adapters, attach_adapters, is_adapter_parameter
from tessera.posttrain.lora_targets import sites, whole_model_sites

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"base_model\.model\.(.+)\.(lora_[AB])\.weight")


@dataclass
class PeftAdapter:
    """A PEFT adapter in tessera's terms: full tensors by tessera parameter name."""

    tensors: dict[str, torch.Tensor]   # e.g. layers.0.attention.qkv.adapter.lora_A
    ranks: dict[str, int]              # by adapted layer path (a fused layer's may exceed r)
    scale: float                       # alpha / r, every adapter's
    dropout: float


# -- which HF modules a tessera layer is -----------------------------------------------

def _family(config: ModelConfig, family: str | None) -> str:
    try:
        return family or infer_family(config)
    except UnsupportedModel as error:
        raise ConfigError(str(error)) from None


def _hf_pieces(path: str, config: ModelConfig, family: str) -> list[tuple[str, int]]:
    """The HF modules fused into the tessera layer at `path`, with their numbers of rows, in the
    order tessera.interop.hf fuses them (q, k, v; gate, up); one line when PEFT has no form of it."""
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", path)
    if family not in LLAMA_LIKE or config.multi_latent_attention or match is None or ".experts." in path + ".":
        raise ConfigError(f"{path}: PEFT adapters cover the attention and MLP projections of the Llama-like "
                          f"families ({', '.join(LLAMA_LIKE)}), not this layer of a {family} model")
    layer, module = f"model.layers.{match[1]}.", match[2]
    q, kv = config.num_attention_heads * config.kv_channels, config.num_query_groups * config.kv_channels
    shared = _SHARED_EXPERTS.get(family, "")
    pieces = {
        "attention.qkv": [("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)],
        "attention.proj": [("self_attn.o_proj", config.hidden_size)],
        "mlp.fc1": [("mlp.gate_proj", config.ffn_hidden_size), ("mlp.up_proj", config.ffn_hidden_size)],
        "mlp.fc2": [("mlp.down_proj", config.hidden_size)],
        "mlp.shared_expert.fc1": [(f"{shared}{p}_proj", config.moe_shared_expert_intermediate_size)
                                  for p in ("gate", "up")],
        "mlp.shared_expert.fc2": [(f"{shared}down_proj", config.hidden_size)],
    }[module]
    return [(layer + name, rows) for name, rows in pieces]


def _layer_path(name: str) -> tuple[str, str]:
    """(adapted layer's path, lora_A or lora_B) of an adapter parameter's name."""
    layer, slot, which = name.rsplit(".", 2)   # e.g. layers.0.attention.qkv, adapter; layers.1.mlp.experts, fc1_adapter
    return (layer if slot == "adapter" else f"{layer}.{slot.removesuffix('_adapter')}"), which


def _parameter_name(path: str, which: str) -> str:
    return f"{path}.adapter.{which}"


# -- export ------------------------------------------------------------------------------

def peft_state_from_tessera(tensors: dict[str, torch.Tensor], config: ModelConfig,
                            family: str | None = None) -> dict[str, torch.Tensor]:
    """PEFT's tensors (adapter_model.safetensors keys) from full adapter tensors by tessera name
    (other tensors, the base's, are left out)."""
    family = _family(config, family)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if is_adapter_parameter(name):
            path, which = _layer_path(name)
            layers.setdefault(path, {})[which] = tensor
    out = {}
    for path, pair in layers.items():
        pieces = _hf_pieces(path, config, family)
        for (module, _), b in zip(pieces, pair["lora_B"].split([rows for _, rows in pieces])):
            out[f"{_PREFIX}{module}.lora_A.weight"] = pair["lora_A"].clone()
            out[f"{_PREFIX}{module}.lora_B.weight"] = b.clone()
    return out


def write_peft_adapter(path: str | os.PathLike, tensors: dict[str, torch.Tensor], config: ModelConfig, *,
                       scale: float, dropout: float, base_model_name_or_path: str | None = None,
                       family: str | None = None) -> None:
    """adapter_config.json and adapter_model.safetensors for full adapter tensors by tessera name
    (`scale`: their alpha / r); `base_model_name_or_path`: the HF export of the base."""
    from safetensors.torch import save_file

    family = _family(config, family)
    state = peft_state_from_tessera(tensors, config, family)
    if not state:
        raise ConfigError("no LoRA adapter tensors to export")
    ranks = {key.removeprefix(_PREFIX).removesuffix(".lora_A.weight"): t.shape[0]
             for key, t in state.items() if key.endswith("lora_A.weight")}
    rank = Counter(ranks.values()).most_common(1)[0][0]
    odd = {module: r for module, r in ranks.items() if r != rank}
    Path(path).mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in state.items()}, Path(path) / WEIGHTS_FILE, metadata={"format": "pt"})
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": _number(scale * rank), "lora_dropout": dropout,
        "target_modules": _target_modules(set(ranks), config, family),
        "rank_pattern": odd, "alpha_pattern": {module: _number(scale * r) for module, r in odd.items()},
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
    }
    (Path(path) / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")


def _number(value: float) -> int | float:
    """alpha as written: scale * r rounds back to the alpha it came from (16/12 * 12 -> 16)."""
    value = float(f"{value:.12g}")
    return int(value) if value.is_integer() else value


def _target_modules(modules: set[str], config: ModelConfig, family: str) -> list[str]:
    """target_modules: a leaf name (q_proj) where every module of that name has an adapter, else
    the modules' full names (PEFT takes either: equal, or ending in '.' + the name)."""
    every: dict[str, set[str]] = {}
    for site in whole_model_sites(config):
        if site.path.startswith("layers.") and ".experts." not in site.path + ".":
            for module, _ in _hf_pieces(site.path, config, family):
                every.setdefault(module.rsplit(".", 1)[-1], set()).add(module)
    targets = []
    for leaf, names in sorted(every.items()):
        chosen = names & modules
        targets += [leaf] if chosen == names else sorted(chosen)
    return targets


def export_peft(model: nn.Module, path: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                family: str | None = None) -> None:
    """write_peft_adapter for a LoRA GPTModel held whole by this process (TP = PP = EP = 1)."""
    found = adapters(model)
    state = adapter_state(model)
    if not found or any(p.shard_spec.size > 1 or p.shard_spec.expert_size > 1 for p in state.values()) \
            or len(model.layers) != model.config.num_layers:
        raise ConfigError("export_peft needs a LoRA model held whole by one process; export a checkpoint's "
                          "adapters with write_peft_adapter")
    scales = {adapter.scale for adapter in found.values()}
    dropouts = {adapter.dropout_p for adapter in found.values()}
    if len(scales) > 1 or len(dropouts) > 1:
        raise ConfigError("the model's adapters differ in scale or dropout; PEFT gives them one lora_alpha / r")
    write_peft_adapter(path, {name: p.detach() for name, p in state.items()}, model.config, scale=scales.pop(),
                       dropout=dropouts.pop(), base_model_name_or_path=base_model_name_or_path, family=family)


# -- import ------------------------------------------------------------------------------

def read_peft_adapter(path: str | os.PathLike, config: ModelConfig, family: str | None = None) -> PeftAdapter:
    """The PEFT adapter at `path` as tessera adapters of the model `config` describes."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ConfigError(f"{path}: not a PEFT adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    peft_config = json.loads((path / CONFIG_FILE).read_text())
    _check_config(peft_config, path / CONFIG_FILE)
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(path / WEIGHTS_FILE).items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ConfigError(f"{path / WEIGHTS_FILE}: '{key}' is not a LoRA weight (base_model.model.<module>."
                              "lora_A.weight / lora_B.weight)")
        modules.setdefault(match[1], {})[match[2]] = tensor
    scale = _peft_scale(peft_config, peft_config["r"], "")
    family = _family(config, family)
    layers = {site.path: _hf_pieces(site.path, config, family) for site in whole_model_sites(config)
              if site.path.startswith("layers.") and ".experts." not in site.path + "."}
    covered = {module for pieces in layers.values() for module, _ in pieces}
    for module in modules:
        if module not in covered:
            raise ConfigError(f"{path / WEIGHTS_FILE}: adapters on {module}, which tessera's adapters do not cover "
                              "(the attention and MLP projections of Llama-like models)")
    tensors, ranks = {}, {}
    for layer, pieces in layers.items():
        found = [(rows, modules.get(module), _peft_scale(peft_config, modules[module]["lora_A"].shape[0], module)
                  if module in modules else None) for module, rows in pieces]
        if any(pair is not None for _, pair, _ in found):
            a, b = _fuse(found, scale)
            tensors[_parameter_name(layer, "lora_A")], tensors[_parameter_name(layer, "lora_B")] = a, b
            ranks[layer] = a.shape[0]
    return PeftAdapter(tensors, ranks, scale, float(peft_config.get("lora_dropout") or 0.0))


def _check_config(peft_config: dict, file: Path) -> None:
    """One line for an adapter tessera would compute differently."""
    wrong = {"peft_type": ("LORA",), "use_dora": (False, None), "bias": ("none", None),
             "fan_in_fan_out": (False, None), "lora_bias": (False, None), "modules_to_save": (None, []),
             "target_parameters": (None, [])}
    for field, accepted in wrong.items():
        if peft_config.get(field, accepted[-1]) not in accepted:
            raise ConfigError(f"{file}: {field} {peft_config[field]!r} is not a plain LoRA adapter "
                              f"(tessera imports {field} {accepted[0]!r})")


def _peft_scale(peft_config: dict, rank: int, module: str) -> float:
    """PEFT's scaling of `module` (LoraLayer.update_layer): alpha / r, or alpha / sqrt(r) with rsLoRA;
    alpha_pattern keys are regexes matched at the end of the module's name (peft.utils.other.get_pattern_key)."""
    alpha = peft_config["lora_alpha"]
    for key, value in (peft_config.get("alpha_pattern") or {}).items():
        if module and re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)


def _fuse(found: list[tuple[int, dict | None, float | None]], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one fused layer from its pieces' (rows, PEFT adapter or None, its scale): one A and
    the B's stacked when every piece has the same A, else block-diagonal; scales folded into B."""
    def b_of(pair: dict, piece_scale: float) -> torch.Tensor:
        return pair["lora_B"] if piece_scale == scale else pair["lora_B"] * (piece_scale / scale)

    present = [(pair, s) for _, pair, s in found if pair is not None]
    first = present[0][0]["lora_A"]
    if len(present) == len(found) and all(torch.equal(pair["lora_A"], first) for pair, _ in present):
        return first, torch.cat([b_of(pair, s) for pair, s in present])
    a = torch.cat([pair["lora_A"] for pair, _ in present])
    b = a.new_zeros(sum(rows for rows, _, _ in found), a.shape[0])
    row = column = 0
    for rows, pair, s in found:
        if pair is not None:
            rank = pair["lora_A"].shape[0]
            b[row:row + rows, column:column + rank] = b_of(pair, s)
            column += rank
        row += rows
    return a, b


def peft_checkpoint_state(path: str | os.PathLike, config: ModelConfig, family: str | None = None
                          ) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The PEFT adapter at `path` as a LoRA checkpoint holds it: its tensors by parameter name, and
    the posttrain section of config.yaml (rank, alpha, dropout) with which a checkpoint is read
    merged (tessera.posttrain.lora_checkpoint) and a run trains it further. An adapter of several
    ranks records the most common one; the others' scales are folded into their B's."""
    adapter = read_peft_adapter(path, config, family)
    if not adapter.tensors:
        raise ConfigError(f"{path}: the adapter holds no LoRA weights")
    rank = Counter(adapter.ranks.values()).most_common(1)[0][0]
    return adapter.tensors, {"posttrain": {"lora_rank": rank, "lora_alpha": _number(adapter.scale * rank),
                                           "lora_dropout": adapter.dropout}}


@torch.no_grad()
def import_peft(model: nn.Module, path: str | os.PathLike, family: str | None = None) -> list[str]:
    """Put the PEFT adapter at `path` on `model` (a GPTModel of any TP rank and pipeline stage, without
    adapters): apply_lora's adapters, with the adapter's ranks, scale and dropout, the base frozen;
    the adapted layers' paths on this stage."""
    adapter = read_peft_adapter(path, model.config, family)
    targets = [site for site in sites(model) if site.path in adapter.ranks]
    paths = attach_adapters(model, targets, adapter.ranks, adapter.scale, adapter.dropout, seed=0)
    for name, param in adapter_state(model).items():
        param.copy_(param.shard_spec.shard(adapter.tensors[name]))
    return paths

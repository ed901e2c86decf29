"""A LoRA checkpoint read as a whole model: its adapters and the base they were trained on.

Adapter checkpoints hold the adapters alone (tessera.training.checkpoint); the base is the run's
--pretrained-checkpoint (a tessera checkpoint or a Hugging Face directory), or the checkpoint
its --load ... --finetune started from, as the checkpoint's config.yaml names them. Reading one
gives the base's weights with the adapters merged in, W + alpha/r B A on the full tensors (exact,
whatever layout trained them; Megatron-Bridge's merge_lora.py does the same), for export,
generation and serving, and keeps the adapters for `tessera convert --peft-adapter`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from tessera.config import ConfigError
from tessera.interop.hf import read_hf_dir, tessera_state_from_hf
from tessera.posttrain.lora import is_adapter_parameter
from tessera.training.checkpoint_files import SavedModel, load_model_checkpoint
from tessera.training.pretrained import is_hf_dir


def read_model(root: str | os.PathLike, extra_files: tuple[str, ...] = (), merge_lora: bool = True) -> SavedModel:
    """The newest checkpoint in `root` as a whole model, read in one process: a LoRA checkpoint's
    adapters with their base, merged into it unless `merge_lora=False`."""
    saved = load_model_checkpoint(root, extra_files)
    if (saved.run_config.get("posttrain") or {}).get("lora_rank"):
        return with_base(saved, root, merge=merge_lora)
    return saved


def base_of(run_config: dict[str, Any]) -> str | None:
    """Where the LoRA run of `run_config` (a config.yaml) took its base from."""
    checkpoint = run_config.get("checkpoint") or {}
    if checkpoint.get("pretrained_checkpoint"):
        return checkpoint["pretrained_checkpoint"]
    if checkpoint.get("finetune") and checkpoint.get("load"):
        return checkpoint["load"]
    return None


def with_base(saved, root: str | os.PathLike, merge: bool = True):
    """`saved` (a SavedModel of LoRA checkpoint `root`, adapters only, or with a base) as the base
    with the adapters merged (or not: `merge=False`), the adapters kept in `.adapters`."""
    adapters = {name: t for name, t in saved.tensors.items() if is_adapter_parameter(name)}
    tensors = {name: t for name, t in saved.tensors.items() if not is_adapter_parameter(name)}
    if not any(name.endswith(".weight") for name in tensors):
        tensors = _base_tensors(saved, root)
    scale = lora_scale(saved.run_config)
    for name, a in adapters.items() if merge else ():
        if not name.endswith(".adapter.lora_A"):
            if name.endswith("lora_A"):
                raise ConfigError(f"{root}: merging MoE experts' adapters ({name}) into the base is not supported")
            continue
        path = name.removesuffix(".adapter.lora_A")
        weight = tensors[f"{path}.weight"]
        delta = adapters[f"{path}.adapter.lora_B"].double() @ a.double()
        tensors[f"{path}.weight"] = (weight.double() + scale * delta).to(weight.dtype)
    return dataclasses.replace(saved, tensors=tensors, adapters=adapters)


def lora_scale(run_config: dict[str, Any]) -> float:
    """alpha / rank of the LoRA run of `run_config`."""
    posttrain = run_config["posttrain"]
    return posttrain["lora_alpha"] / posttrain["lora_rank"]


def _base_tensors(saved, root: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full weights of the base a LoRA checkpoint names (tessera or Hugging Face)."""
    base = base_of(saved.run_config)
    if base is None or not Path(base).exists():
        raise ConfigError(f"{root} holds LoRA adapters; their base ({base or 'not recorded'}) is not there: give "
                          "the directory of its --pretrained-checkpoint")
    if not is_hf_dir(base):
        return load_model_checkpoint(base).tensors
    hf_config, hf_tensors = read_hf_dir(base)
    return tessera_state_from_hf(hf_config, hf_tensors, saved.config)

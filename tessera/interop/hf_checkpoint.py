"""Hugging Face model directories <-> tessera checkpoints, whole: weights, config and tokenizer.

    hf_to_tessera("hf_dir", "ckpt_dir")         # a tessera checkpoint (--load ckpt_dir --finetune)
    tessera_to_hf("ckpt_dir", "hf_dir")         # config.json + safetensors (sharded when large) + tokenizer

The tensors and config map in tessera.interop.hf and tessera.interop.hf_config; this module adds
tessera's checkpoint files, the tokenizer and PEFT adapters around them. It sits above
tessera.interop.hf because tessera's checkpoint reader reads a LoRA run's HF base through that
module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tessera.config import ConfigError
from tessera.data.tokenizers import copy_tokenizer_files, hf_tokenizer_files
from tessera.interop.hf import hf_model_config, hf_state_from_tessera, read_hf_dir, tessera_state_from_hf, \
    write_hf_dir
from tessera.interop.hf_config import hf_config_from_model, infer_family
from tessera.interop.hf_peft import peft_checkpoint_state, write_peft_adapter
from tessera.interop.hf_tokenizer import write_hf_tokenizer
from tessera.posttrain.lora_checkpoint import lora_scale, read_model
from tessera.training.checkpoint_files import save_model_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_to_tessera(hf_dir: str | os.PathLike, checkpoint_dir: str | os.PathLike, *, vocab_multiple: int = 128,
                  peft_adapter: str | os.PathLike | None = None) -> None:
    """Write the HF model at `hf_dir` as a tessera checkpoint (weights and model config, fp32), with the
    directory's tokenizer files (and generation config) beside it: `tessera generate --load` and
    `tessera serve --load` find the tokenizer, chat template and EOS ids there. With `peft_adapter`
    (a PEFT adapter of that model) the checkpoint is a LoRA one holding the base and the adapters
    (tessera.interop.hf_peft.peft_checkpoint_state)."""
    hf_config, tensors = read_hf_dir(hf_dir)
    config = hf_model_config(hf_config, tensors, vocab_multiple)
    state, sections = tessera_state_from_hf(hf_config, tensors, config), None
    if peft_adapter is not None:
        adapters, sections = peft_checkpoint_state(peft_adapter, config, hf_config["model_type"])
        state.update(adapters)
    save_model_checkpoint(checkpoint_dir, config, state, sections=sections,
                          extra_files={"hf_config.json": json.dumps(hf_config, indent=2, sort_keys=True)})
    copy_tokenizer_files(hf_tokenizer_files(hf_dir), checkpoint_dir)


def tessera_to_hf(checkpoint_dir: str | os.PathLike, hf_dir: str | os.PathLike, *, family: str | None = None,
                  dtype: str | None = None, max_shard_bytes: int = 5 * 2**30,
                  peft_adapter: str | os.PathLike | None = None) -> str:
    """Write the newest tessera checkpoint in `checkpoint_dir` as an HF model directory: config.json,
    safetensors, and the checkpoint's tokenizer as transformers loads it (tessera.interop.hf_tokenizer);
    what was written of the tokenizer, in words.

    The family defaults to the imported model's (or is inferred from the architecture); the
    dtype to the imported model's, else float32. The tokenizer's special ids go into config.json
    where the imported config has none. A LoRA checkpoint is written merged; with `peft_adapter`
    its base is, and its adapters as a PEFT adapter directory there (tessera.interop.hf_peft).
    """
    saved = read_model(checkpoint_dir, extra_files=("hf_config.json",), merge_lora=peft_adapter is None)
    if peft_adapter is not None and not saved.adapters:
        raise ConfigError(f"{checkpoint_dir}: --peft-adapter needs a LoRA checkpoint (trained with --lora-rank)")
    base = json.loads(saved.files["hf_config.json"]) if "hf_config.json" in saved.files else None
    family = family or (base or {}).get("model_type") or infer_family(saved.config)
    dtype = dtype or (base or {}).get("dtype") or (base or {}).get("torch_dtype") or "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype '{dtype}' is not one of {', '.join(_DTYPES)}")
    hf_config = hf_config_from_model(saved.config, family, base, dtype)   # refuses what HF cannot compute, first
    tensors = hf_state_from_tessera(saved.tensors, saved.config, family, _DTYPES[dtype])
    Path(hf_dir).mkdir(parents=True, exist_ok=True)
    tokenizer, special_ids = write_hf_tokenizer(Path(checkpoint_dir), saved.run_config, Path(hf_dir))
    for name, token_id in special_ids.items():
        hf_config.setdefault(name, token_id)
    write_hf_dir(hf_dir, hf_config, tensors, max_shard_bytes)
    if peft_adapter is not None:
        write_peft_adapter(peft_adapter, saved.adapters, saved.config, scale=lora_scale(saved.run_config),
                           dropout=saved.run_config["posttrain"]["lora_dropout"],
                           base_model_name_or_path=str(Path(hf_dir).resolve()), family=family)
    return tokenizer

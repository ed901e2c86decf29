"""The model a fine-tuning run starts from: --pretrained-checkpoint (a tessera checkpoint or a
Hugging Face directory) and --use-checkpoint-args (the model flags read from a checkpoint).

A Hugging Face directory is converted as it loads: each node's first rank writes it once as a
tessera checkpoint in the node's temporary directory (`tessera convert hf-to-tessera`), every
rank reads its own shards from there through torch.distributed.checkpoint, as from any other
checkpoint (so TP, PP, EP, FSDP2 and the distributed optimizer's masters need nothing of their
own), and the copy is removed when every rank has loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tessera.config import ConfigError


def is_hf_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a local Hugging Face model directory (config.json and weights)."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def checkpoint_model_values(path: str | os.PathLike, flag: str) -> dict[str, Any]:
    """The model flags of the checkpoint at `path` (its newest iteration), or of the Hugging Face
    model there; one line naming `flag` when it is neither."""
    from tessera.training.checkpoint_files import saved_run_config

    if is_hf_dir(path):
        from tessera.interop.hf_config import model_config_from_hf
        from tessera.interop.hf_fields import UnsupportedModel

        try:
            return dataclasses.asdict(model_config_from_hf(json.loads((Path(path) / "config.json").read_text())))
        except UnsupportedModel as exc:
            raise ConfigError(f"{flag} {path}: {exc}") from None
    return saved_run_config(newest_checkpoint(path, flag))["model"]


def newest_checkpoint(path: str | os.PathLike, flag: str) -> Path:
    """The newest complete checkpoint of the tessera checkpoint directory `path`; one line naming
    `flag` when there is none."""
    from tessera.training.checkpoint_files import complete_checkpoints

    found = complete_checkpoints(path) if Path(path).is_dir() else []
    if not found:
        raise ConfigError(f"{flag} {path}: neither a tessera checkpoint directory nor a Hugging Face model "
                          "directory (config.json and *.safetensors)")
    return found[0]


def model_from_checkpoint(values: dict[str, dict[str, Any]]) -> str | None:
    """Megatron-LM's --use-checkpoint-args on the resolved flags ({section: {field: value}}): the
    model section becomes the checkpoint's, but for the fields a run may change (which the command
    line keeps). Done unasked when no model is given (no --num-layers, preset or YAML). Returns the
    note to print, or None when nothing was read."""
    checkpoint, model = values["checkpoint"], values["model"]
    asked = checkpoint.get("use_checkpoint_args", False)
    if not asked and "num_layers" in model:
        return None
    from tessera.training.checkpoint_files import FIELDS_THAT_MAY_CHANGE, complete_checkpoints

    load, pretrained = checkpoint.get("load"), checkpoint.get("pretrained_checkpoint")
    if load is not None and Path(load).is_dir() and complete_checkpoints(load, warn=lambda message: None):
        source, flag = load, "--load"
    elif pretrained is not None:
        source, flag = pretrained, "--pretrained-checkpoint"
    elif asked:
        raise ConfigError("--use-checkpoint-args needs a checkpoint in --load or a --pretrained-checkpoint")
    else:
        return None
    kept = {name: value for name, value in model.items() if name in FIELDS_THAT_MAY_CHANGE}
    values["model"] = {**checkpoint_model_values(source, flag), **kept}
    return f"note: the model's flags are {flag} {source}'s"


def converted_checkpoint(hf_dir: str | os.PathLike, vocab_multiple: int) -> Path:
    """The tessera checkpoint of a Hugging Face model, written once per node (call on every rank),
    its vocabulary padded to a multiple of `vocab_multiple` (--make-vocab-size-divisible-by)."""
    from tessera.parallel.launch import build_in_turns

    source = Path(hf_dir).resolve()
    stamp = f"{source}:{max(p.stat().st_mtime_ns for p in source.iterdir())}:{vocab_multiple}"
    target = Path(tempfile.gettempdir()) / f"tessera-pretrained-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"

    def convert() -> Path:
        # `tessera convert` in a process of its own: a checkpoint save is collective over the
        # process group this rank is in, which the other ranks, waiting at a barrier, are not.
        if not target.is_dir():
            partial = target.with_name(target.name + f".partial-{os.getpid()}")
            result = subprocess.run([sys.executable, "-m", "tessera", "convert", "hf-to-tessera", "--input",
                                     str(source), "--output", str(partial), "--make-vocab-size-divisible-by",
                                     str(vocab_multiple)], capture_output=True, text=True)
            if result.returncode:
                raise ConfigError(f"--pretrained-checkpoint {source}: {result.stderr.strip().splitlines()[-1]}")
            partial.rename(target)
        return target

    return build_in_turns(convert)


def remove_converted(directory: Path) -> None:
    """Remove a node's converted copy once every rank has read it."""
    if dist.is_initialized():
        dist.barrier()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(directory, ignore_errors=True)

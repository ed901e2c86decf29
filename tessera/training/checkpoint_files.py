"""A checkpoint on disk: Megatron-LM's layout, written so that a crash never corrupts it.

    SAVE_DIR/latest_checkpointed_iteration.txt   "1000": the newest complete checkpoint
    SAVE_DIR/tokenizer/                          copies of the files the run's tokenizer read
    SAVE_DIR/iter_0001000/config.yaml            the run's configuration
    SAVE_DIR/iter_0001000/.metadata, *.distcp    DCP: every tensor by full-tensor coordinates

The tracker is replaced atomically (write, fsync, rename) only after every rank has finished,
so a process killed mid-save leaves it on the previous checkpoint; checkpoints newer than the
tracker or without DCP's .metadata are skipped with a warning naming them.

The tokenizer travels with the model: its files are copied into SAVE_DIR/tokenizer/ at the
first save (an identical copy is left alone), and config.yaml names the copies relative to
SAVE_DIR, so that `tessera generate/serve/convert` find them from any working directory, even
once the original files are gone (`saved_run_config` resolves them).

Weights-only checkpoints (`save_model_checkpoint`, `load_model_checkpoint`) are what Hugging
Face conversion writes and what generation and export read, in one process, without a trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from tessera.config import DataConfig, ModelConfig
from tessera.data.tokenizers import copy_tokenizer_files, tokenizer_files
from tessera.files import atomic_write
from tessera.training.checkpoint_state import LoadPlanner, SavePlanner, saved_like, whole

TRACKER = "latest_checkpointed_iteration.txt"
# Files each rank writes in parallel (DCP's FileSystemWriter threads): on an H200 host, 8 threads
# wrote an async checkpoint 4.7x faster than 1 (docs/performance-notes.md).
WRITE_THREADS = 8
CONFIG = "config.yaml"
TOKENIZER_DIR = "tokenizer"
_TOKENIZER_PATHS = ("tokenizer_model", "vocab_file", "merge_file")   # DataConfig fields naming tokenizer files


@contextlib.contextmanager
def single_process_ok():
    """DCP warns when no process group exists that it assumes one process: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def iteration_dir(root: str | os.PathLike, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def read_tracker(root: str | os.PathLike) -> int | None:
    try:
        return int((Path(root) / TRACKER).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _atomic_write(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a part; fsynced, as the tracker must be."""
    atomic_write(path, lambda file: file.write(text.encode("utf-8")), durable=True)


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log_warning(message: str) -> None:
    """A warning line on standard error, from rank 0 only."""
    if global_rank() == 0:
        print(f"tessera checkpoint: warning: {message}", file=sys.stderr, flush=True)


def log_info(message: str) -> None:
    """A line on standard output, from rank 0 only."""
    if global_rank() == 0:
        print(f"tessera checkpoint: {message}", flush=True)


def complete_checkpoints(root: str | os.PathLike, warn: Callable[[str], None] = log_warning) -> list[Path]:
    """Checkpoints in `root` that finished writing, newest first; the others named in warnings."""
    tracked = read_tracker(root)
    found = []
    for directory in sorted(Path(root).glob("iter_*"), reverse=True):
        iteration = int(directory.name.removeprefix("iter_"))
        if tracked is not None and iteration > tracked:
            warn(f"skipping {directory}: newer than {TRACKER} ({tracked}), its save did not finish")
        elif not (directory / ".metadata").is_file() or not (directory / CONFIG).is_file():
            warn(f"skipping {directory}: incomplete (no .metadata or {CONFIG})")
        else:
            found.append(directory)
    return found


def write_checkpoint(directory: Path, state: dict[str, Any], config: dict, *, group=None,
                     keep_last: int | None = None, extra_files: dict[str, str] | None = None,
                     thread_count: int = WRITE_THREADS) -> int:
    """Write one checkpoint (collective over `group`; each rank's files by `thread_count` threads),
    then point the tracker at it; the bytes of its data files (every rank's, as DCP's metadata
    records them)."""
    rank0 = not dist.is_initialized() or dist.get_rank(group) == 0
    directory.mkdir(parents=True, exist_ok=True)
    if rank0:
        (directory / ".metadata").unlink(missing_ok=True)  # an earlier, interrupted save of this iteration
        for name, text in {CONFIG: yaml.safe_dump(config, sort_keys=False), **(extra_files or {})}.items():
            _atomic_write(directory / name, text)
    with single_process_ok():
        writer = dcp.FileSystemWriter(directory, thread_count=thread_count)
        metadata = dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=group)
    if dist.is_initialized():
        dist.barrier(group=group)  # every rank's files are complete
    if rank0:
        root = directory.parent
        _atomic_write(root / TRACKER, str(int(directory.name.removeprefix("iter_"))))
        if keep_last:
            for old in complete_checkpoints(root, warn=lambda _: None)[keep_last:]:
                shutil.rmtree(old, ignore_errors=True)
    return sum(stored.length for stored in metadata.storage_data.values())


def copy_tokenizer(data: DataConfig, root: Path) -> dict[str, str]:
    """Copy the files the tokenizer of `data` reads into root/tokenizer/; the DataConfig fields
    that name them, pointing at the copies (relative to `root`)."""
    paths = {}
    for field, files in tokenizer_files(data).items():
        copy_tokenizer_files(files, root / TOKENIZER_DIR)
        source = Path(getattr(data, field))
        paths[field] = TOKENIZER_DIR if source.is_dir() else f"{TOKENIZER_DIR}/{source.name}"
    return paths


def saved_run_config(directory: Path) -> dict[str, Any]:
    """The config.yaml of checkpoint `directory` (SAVE_DIR/iter_N), its tokenizer paths made absolute
    where they name the copies in SAVE_DIR (a checkpoint of an older tessera names the originals)."""
    config = yaml.safe_load((directory / CONFIG).read_text())
    data = config.get("data") or {}
    for field in _TOKENIZER_PATHS:
        path = data.get(field)
        if path and not os.path.isabs(path) and (directory.parent / path).exists():
            data[field] = str((directory.parent / path).resolve())
    return config


# -- weights-only checkpoints (Hugging Face conversion, generation) ----------------------

def save_model_checkpoint(root: str | os.PathLike, model: ModelConfig, tensors: dict[str, torch.Tensor],
                          extra_files: dict[str, str] | None = None, sections: dict[str, dict] | None = None) -> None:
    """A checkpoint of full weights at iteration 0, from one process (--load DIR --finetune);
    `sections` adds to its config.yaml (a LoRA checkpoint's posttrain settings)."""
    state = {f"model.{name}": whole(t) for name, t in tensors.items()}
    write_checkpoint(iteration_dir(root, 0), state, {"model": dataclasses.asdict(model), **(sections or {})},
                     extra_files=extra_files)


# Model fields a run may change on resume (fine-tuning, longer sequences with RoPE);
# the parameters' shapes are checked on their own.
FIELDS_THAT_MAY_CHANGE = {
    "seq_length", "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
    # how MoE layers train, not what they hold
    "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
    "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
    "moe_grouped_gemm", "moe_router_dtype",
    "mtp_loss_scaling_factor",   # DeepSeek-V3 lowered it from 0.3 to 0.1 during training
}


@dataclasses.dataclass
class SavedModel:
    """What one process reads of a checkpoint to generate with or convert."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]   # full weights by parameter name
    run_config: dict[str, Any]         # config.yaml (saved_run_config: tokenizer paths resolved)
    files: dict[str, str]              # the extra files asked for that the checkpoint has
    adapters: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)   # LoRA's, merged into `tensors`


def load_model_checkpoint(root: str | os.PathLike, extra_files: tuple[str, ...] = ()) -> SavedModel:
    """The newest checkpoint in `root`, read in one process, as it was saved (a LoRA checkpoint's
    adapters alone: tessera.posttrain.lora_checkpoint.read_model reads them with their base)."""
    candidates = complete_checkpoints(root)
    if not candidates:
        raise FileNotFoundError(f"{root}: no complete tessera checkpoint")
    directory = candidates[0]
    run_config = saved_run_config(directory)
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    state = {key: saved_like(md) for key, md in metadata.items() if key.startswith("model.")}
    with single_process_ok():
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=LoadPlanner())
    tensors = {key.removeprefix("model."): value.blocks[0][1] for key, value in state.items()}
    files = {name: (directory / name).read_text() for name in extra_files if (directory / name).is_file()}
    return SavedModel(ModelConfig(**run_config["model"]), tensors, run_config, files)

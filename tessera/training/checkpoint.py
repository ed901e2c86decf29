"""Saving and resuming: sharded, reshardable checkpoints that a crash never corrupts.

On disk (Megatron's layout; one torch.distributed.checkpoint directory per save):

    SAVE_DIR/latest_checkpointed_iteration.txt   "1000": the newest complete checkpoint
    SAVE_DIR/iter_0001000/config.yaml            the run's configuration
    SAVE_DIR/iter_0001000/.metadata, *.distcp    DCP: every tensor by full-tensor coordinates

Every rank writes its own pieces (tessera.training.checkpoint_state) and DCP records
where each sits in the full tensor, so any layout can load them. FP8 delayed scaling's
amax histories are saved by layer name beside the model (a run without FP8 ignores them;
an FP8 layer the checkpoint lacks starts its history fresh). The tracker is replaced
atomically (write, fsync, rename) only after every rank has finished, so a
process killed mid-save leaves the tracker on the previous checkpoint; on --load,
checkpoints newer than the tracker or without DCP's .metadata are skipped with a
warning, and one that fails to read is skipped for the next older one.

`Checkpointer` is what the trainer calls: it loads at start, saves every
--save-interval, and on --exit-interval / --exit-duration-in-mins / SIGTERM
(--exit-signal-handler) saves and tells the loop to stop. With --async-save the state
is copied into pinned CPU buffers (allocated at the first save and reused) and written by
a background thread on a gloo group of its own: training waits only for that copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import yaml

from tessera.config import ConfigError, ModelConfig, RunConfig, flag
from tessera.files import atomic_write
from tessera.training.checkpoint_state import (
    Chunked, LoadPlanner, SavePlanner, fp8_scaling_state, fp8_scaling_targets, master_state, master_weights,
    model_state, optimizer_state, optimizer_steps, restore_fp8_scaling, saved_like, set_optimizer_steps, whole,
)

TRACKER = "latest_checkpointed_iteration.txt"
# Files each rank writes in parallel (DCP's FileSystemWriter threads): on an H200 host, 8 threads
# wrote an async checkpoint 4.7x faster than 1 (docs/performance.md).
WRITE_THREADS = 8
CONFIG = "config.yaml"
# Model fields a run may change on resume (fine-tuning, longer sequences with RoPE);
# the parameters' shapes are checked on their own.
_MAY_CHANGE = {"seq_length", "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
               # how MoE layers train, not what they hold
               "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
               "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_pad_expert_input_to_capacity",
               "moe_grouped_gemm", "moe_router_dtype",
               "mtp_loss_scaling_factor"}   # DeepSeek-V3 lowered it from 0.3 to 0.1 during training


@contextlib.contextmanager
def _single_process_ok():
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


def _warn(message: str) -> None:
    if _rank() == 0:
        print(f"tessera checkpoint: warning: {message}", file=sys.stderr, flush=True)


def _info(message: str) -> None:
    if _rank() == 0:
        print(f"tessera checkpoint: {message}", flush=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def complete_checkpoints(root: str | os.PathLike, warn: Callable[[str], None] = _warn) -> list[Path]:
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
                     keep_last: int | None = None, extra_files: dict[str, str] | None = None) -> None:
    """Write one checkpoint (collective over `group`), then point the tracker at it."""
    rank0 = not dist.is_initialized() or dist.get_rank(group) == 0
    directory.mkdir(parents=True, exist_ok=True)
    if rank0:
        (directory / ".metadata").unlink(missing_ok=True)  # an earlier, interrupted save of this iteration
        for name, text in {CONFIG: yaml.safe_dump(config, sort_keys=False), **(extra_files or {})}.items():
            _atomic_write(directory / name, text)
    with _single_process_ok():
        writer = dcp.FileSystemWriter(directory, thread_count=WRITE_THREADS)
        dcp.save(state, storage_writer=writer, planner=SavePlanner(), process_group=group)
    if dist.is_initialized():
        dist.barrier(group=group)  # every rank's files are complete
    if rank0:
        root = directory.parent
        _atomic_write(root / TRACKER, str(int(directory.name.removeprefix("iter_"))))
        if keep_last:
            for old in complete_checkpoints(root, warn=lambda _: None)[keep_last:]:
                shutil.rmtree(old, ignore_errors=True)


def model_config_differences(saved: dict[str, Any], current: ModelConfig) -> list[str]:
    """'--flag: checkpoint X, run Y' for each architecture field that differs."""
    differences = []
    for name, value in dataclasses.asdict(current).items():
        if name in _MAY_CHANGE or (name == "max_position_embeddings" and current.position_embedding_type == "rope"):
            continue
        if saved.get(name, value) != value:
            differences.append(f"{flag(name)}: checkpoint {saved[name]!r}, this run {value!r}")
    return differences


def _check_tensors(state: dict[str, Any], metadata: dict, directory: Path) -> None:
    problems = []
    for key, value in state.items():
        if not isinstance(value, Chunked):
            continue
        if key not in metadata:
            problems.append(f"{key}: not in the checkpoint")
        elif tuple(metadata[key].size) != value.full_shape:
            problems.append(f"{key}: checkpoint {tuple(metadata[key].size)}, this run {value.full_shape}")
    if problems:
        raise ConfigError(f"{directory} does not fit this model:\n  " + "\n  ".join(problems))


# -- the trainer's side -----------------------------------------------------------------

def _layout(trainer) -> dict[str, int]:
    mesh = trainer.mesh
    return {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size, "cp": mesh.cp_size, "ep": mesh.ep_size,
            "etp": mesh.etp_size}


def _rng_state(trainer) -> dict[str, Any]:
    cuda = trainer.device.type == "cuda"
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(trainer.device) if cuda else None,
            "dropout": trainer.model.dropout_rng.state_dict()}


def _set_rng_state(trainer, state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], trainer.device)
    trainer.model.dropout_rng.load_state_dict(state["dropout"])


def training_state(trainer) -> dict[str, Any]:
    """Everything an exact resume needs, as DCP entries."""
    # With bf16 weights beside a distributed optimizer's fp32 masters, only the masters are
    # saved (each rank its slices): adding the bf16 copy would put two versions of the same
    # block in the plan, and DCP keeps one of them.
    masters = master_weights(trainer.optimizer)
    state: dict[str, Any] = master_state(trainer.model, masters) if masters else model_state(trainer.model)
    state.update(optimizer_state(trainer.model, trainer.optimizer))
    state.update(fp8_scaling_state(trainer.model))   # FP8 delayed scaling's amax histories and scales
    state["train_state"] = {
        "iteration": trainer.iteration, "consumed_samples": trainer.consumed_samples,
        "skipped_iterations": trainer.skipped_iterations, "nan_iterations": trainer.nan_iterations,
        "loss_scaler": trainer.loss_scaler.state_dict(), "optimizer_steps": optimizer_steps(trainer.optimizer),
        "layout": _layout(trainer),
    }
    state[f"rng.{_rank()}"] = _rng_state(trainer)  # one per rank: keys differ, so DCP keeps all
    return state


class Checkpointer:
    """Loads at the start of a run; saves and stops it when due."""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config, self.options, self.train = config, config.checkpoint, config.train
        self.device = device
        self.last_saved: int | None = None
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._staging: dict[tuple[str, int], torch.Tensor] = {}   # async save's CPU copies, reused
        self._start = time.monotonic()
        self._sigterm = False
        # Background writes must not interleave their collectives with training's.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() and self.options.async_save else None

    @contextlib.contextmanager
    def exit_signal(self):
        """While training, with --exit-signal-handler: SIGTERM asks for a save and a stop at the end of
        the iteration. The handler before it comes back afterwards, so that a process (or a worker it
        forks later) does not keep ignoring SIGTERM once training is over."""
        if not self.train.exit_signal_handler:
            yield
            return
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _on_sigterm(self, _signum, _frame) -> None:
        self._sigterm = True

    # -- saving --------------------------------------------------------------------------

    def save(self, trainer) -> None:
        directory = iteration_dir(self.options.save, trainer.iteration)
        trainer.optimizer.wait_for_parameters()   # --overlap-param-gather: weights still arriving
        state = training_state(trainer)
        self.last_saved = trainer.iteration
        args = dict(config=self.config.to_dict(), keep_last=self.options.keep_last)
        if not self.options.async_save:
            write_checkpoint(directory, state, group=None, **args)
            return
        self.wait()   # the previous write is done with the staging buffers
        staged = self._stage(state)
        self._writer = threading.Thread(target=self._write_in_background, args=(directory, staged, args))
        self._writer.start()

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state with every tensor copied to CPU memory: what the background writer reads
        while training changes the originals. Pinned buffers make the copy run at PCIe speed
        (pageable ones take several times longer); keeping them means only the first save
        pays for allocating and pinning them."""
        staged = {}
        for key, value in state.items():
            if not isinstance(value, Chunked):
                staged[key] = value
                continue
            blocks = []
            for index, (offset, view) in enumerate(value.blocks):
                buffer = self._staging.get((key, index))
                if buffer is None or buffer.shape != view.shape or buffer.dtype != view.dtype:
                    buffer = torch.empty(view.shape, dtype=view.dtype, pin_memory=view.is_cuda)
                    self._staging[(key, index)] = buffer
                buffer.copy_(view.detach(), non_blocking=True)
                blocks.append((offset, buffer))
            staged[key] = Chunked(value.full_shape, blocks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # the copies have landed before the writer reads them
        return staged

    def _write_in_background(self, directory: Path, state: dict, args: dict) -> None:
        try:
            write_checkpoint(directory, state, group=self._group, **args)
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the training thread by wait()
            self._writer_error = exc

    @property
    def writing(self) -> bool:
        """A background save is still being written."""
        return self._writer is not None and self._writer.is_alive()

    def wait(self) -> None:
        """Block until a background save has finished; raise its error if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._writer_error is not None:
            error, self._writer_error = self._writer_error, None
            raise RuntimeError("asynchronous checkpoint save failed") from error

    def _exit_reason(self, trainer) -> str | None:
        reasons = []
        if self.train.exit_interval and trainer.iteration % self.train.exit_interval == 0:
            reasons.append("--exit-interval")
        if self.train.exit_signal_handler or self.train.exit_duration_in_mins:
            # Every rank must stop at the same iteration: agree on what any one of them saw.
            minutes = (time.monotonic() - self._start) / 60
            seen = torch.tensor([self._sigterm, bool(self.train.exit_duration_in_mins)
                                 and minutes >= self.train.exit_duration_in_mins], device=self.device, dtype=torch.int32)
            if dist.is_initialized():
                dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            reasons += [name for name, hit in zip(("SIGTERM", "--exit-duration-in-mins"), seen.tolist()) if hit]
        return " and ".join(reasons) or None

    def after_iteration(self, trainer) -> bool:
        """Save if due; True when the run must stop now (after saving, with --save)."""
        reason = self._exit_reason(trainer)
        interval = self.options.save_interval
        if self.options.save and (reason or (interval and trainer.iteration % interval == 0)):
            self.save(trainer)
        if reason:
            trainer.metrics.info(f"exiting at iteration {trainer.iteration} ({reason})")
        return reason is not None

    def finish(self, trainer) -> None:
        """At the end of the run: save the final state (Megatron does too) and wait for writes."""
        if self.options.save and self.last_saved != trainer.iteration:
            self.save(trainer)
        self.wait()

    # -- loading -------------------------------------------------------------------------

    def load(self, trainer) -> None:
        """Resume from the newest readable checkpoint in --load (nothing there: start fresh)."""
        root = self.options.load
        candidates = complete_checkpoints(root)
        if not candidates:
            _warn(f"--load {root}: no complete checkpoint, starting from scratch")
            return
        for directory in candidates:
            try:
                self._load_from(directory, trainer)
                _info(f"loaded {directory} (iteration {trainer.iteration})")
                return
            except ConfigError:
                raise
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- corrupt: fall back to an older one
                _warn(f"skipping {directory}: cannot be read ({type(exc).__name__}: {str(exc)[:300]})")
        raise RuntimeError(f"--load {root}: none of its checkpoints could be read")

    def _load_from(self, directory: Path, trainer) -> None:
        saved = yaml.safe_load((directory / CONFIG).read_text())
        differences = model_config_differences(saved["model"], self.config.model)
        if differences:
            raise ConfigError(f"{directory} was saved for another model; differing settings:\n  "
                              + "\n  ".join(differences))
        metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        weights_only = self.options.finetune or "train_state" not in metadata
        state: dict[str, Any] = model_state(trainer.model)
        if not (weights_only or self.options.no_load_optim):
            state.update(optimizer_state(trainer.model, trainer.optimizer, create=True))
        _check_tensors(state, metadata, directory)
        if not weights_only:
            state["train_state"] = None
            state.update(fp8_scaling_targets(trainer.model, metadata))
        rng_key = f"rng.{_rank()}"
        if not (weights_only or self.options.no_load_rng) and rng_key in metadata:
            state[rng_key] = None
        with _single_process_ok():
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=LoadPlanner())
        # Delayed scaling's scales first: storing the masters casts the weights that
        # --fp8-param-gather gathers in E4M3, with these scales.
        missing = [] if weights_only else restore_fp8_scaling(trainer.model, state)
        trainer.optimizer.cast_fp8_shards()   # FSDP2's E4M3 shards, from the weights just loaded
        masters = master_weights(trainer.optimizer)
        if masters:  # fp32 masters read from the same (fp32) weights, not from the bf16 copy
            dcp.load(master_state(trainer.model, masters), storage_reader=dcp.FileSystemReader(directory),
                     planner=LoadPlanner())
            trainer.optimizer.inner.store_master_weights(masters)
        if weights_only:
            return
        train_state = state["train_state"]
        trainer.iteration, trainer.consumed_samples = train_state["iteration"], train_state["consumed_samples"]
        trainer.skipped_iterations = train_state["skipped_iterations"]
        trainer.nan_iterations = train_state["nan_iterations"]
        trainer.loss_scaler.load_state_dict(train_state["loss_scaler"])
        if not self.options.no_load_optim and train_state["optimizer_steps"] is not None:
            set_optimizer_steps(trainer.optimizer, train_state["optimizer_steps"])
        if missing:
            _warn(f"{directory} has no FP8 delayed-scaling state for {len(missing)} layers (e.g. {missing[0]}): "
                  "their amax histories start fresh")
        self.last_saved = trainer.iteration
        if rng_key in state and train_state["layout"] == _layout(trainer):
            _set_rng_state(trainer, state[rng_key])
        elif not self.options.no_load_rng:
            _warn(f"random states not restored: saved with layout {train_state['layout']}, "
                  f"now {_layout(trainer)} (dropout masks will differ from the original run)")


# -- weights-only checkpoints (Hugging Face conversion) ----------------------------------

def save_model_checkpoint(root: str | os.PathLike, model: ModelConfig, tensors: dict[str, torch.Tensor],
                          extra_files: dict[str, str] | None = None) -> None:
    """A checkpoint of full weights at iteration 0, from one process (--load DIR --finetune)."""
    state = {f"model.{name}": whole(t) for name, t in tensors.items()}
    write_checkpoint(iteration_dir(root, 0), state, {"model": dataclasses.asdict(model)}, extra_files=extra_files)


def load_model_checkpoint(root: str | os.PathLike, extra_files: tuple[str, ...] = ()
                          ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, str]]:
    """(model config, full weights, the named extra files present) of the newest checkpoint, in one process."""
    candidates = complete_checkpoints(root)
    if not candidates:
        raise FileNotFoundError(f"{root}: no complete tessera checkpoint")
    directory = candidates[0]
    config = ModelConfig(**yaml.safe_load((directory / CONFIG).read_text())["model"])
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    state = {key: saved_like(md) for key, md in metadata.items() if key.startswith("model.")}
    with _single_process_ok():
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=LoadPlanner())
    tensors = {key.removeprefix("model."): value.blocks[0][1] for key, value in state.items()}
    extra = {name: (directory / name).read_text() for name in extra_files if (directory / name).is_file()}
    return config, tensors, extra

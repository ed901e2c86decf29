"""Saving and resuming: sharded, reshardable checkpoints (Megatron's layout, on disk as
tessera.training.checkpoint_files describes it).

Every rank writes its own pieces (tessera.training.checkpoint_state) and DCP records
where each sits in the full tensor, so any layout can load them. FP8 delayed scaling's
amax histories are saved by layer name beside the model (a run without FP8 ignores them;
an FP8 layer the checkpoint lacks starts its history fresh). On --load, a checkpoint that
fails to read is skipped for the next older one.

`Checkpointer` is what the trainer calls: it loads at start, saves every
--save-interval, and on --exit-interval / --exit-duration-in-mins / SIGTERM
(--exit-signal-handler) saves and tells the loop to stop. With --async-save the state
is copied into pinned CPU buffers (allocated at the first save and reused) and written by
a background thread on a gloo group of its own: training waits only for that copy. The
first save copies the run's tokenizer files into --save, beside the checkpoints.

Rank 0 says what happened in one line each: every save (iteration, directory, seconds and
size, as Megatron-LM's `save_checkpoint` logs it; for an async save the seconds training was
blocked), and a --load that starts fresh. A --load directory that does not exist is an error,
unless it is also the --save directory (Megatron-LM's auto-resume idiom `--save $CKPT --load
$CKPT`, whose first launch finds nothing to load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tessera.config import ConfigError, ModelConfig, RunConfig, flag
from tessera.data.tokenizers import tokenizer_files
from tessera.training import compile_artifacts
from tessera.training.checkpoint_files import (
    FIELDS_THAT_MAY_CHANGE, WRITE_THREADS, complete_checkpoints, copy_tokenizer, global_rank, iteration_dir, log_info,
    log_warning, saved_run_config, single_process_ok, write_checkpoint,
)
from tessera.training.checkpoint_state import (
    Chunked, LoadPlanner, fp8_scaling_state, fp8_scaling_targets, master_state, master_weights, model_state,
    optimizer_state, optimizer_steps, restore_fp8_scaling, set_optimizer_steps,
)
from tessera.training.pretrained import converted_checkpoint, is_hf_dir, newest_checkpoint, remove_converted

def model_config_differences(saved: dict[str, Any], current: ModelConfig) -> list[str]:
    """'--flag: checkpoint X, run Y' for each architecture field that differs."""
    differences = []
    for name, value in dataclasses.asdict(current).items():
        if name in FIELDS_THAT_MAY_CHANGE or (name == "max_position_embeddings"
                                              and current.position_embedding_type == "rope"):
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
    # A frozen base (LoRA) is not saved again: it is --pretrained-checkpoint's.
    state: dict[str, Any] = master_state(trainer.model, masters) if masters else \
        model_state(trainer.model, frozen=not trainer.config.posttrain.lora)
    state.update(optimizer_state(trainer.model, trainer.optimizer))
    state.update(fp8_scaling_state(trainer.model))   # FP8 delayed scaling's amax histories and scales
    state["train_state"] = {
        "iteration": trainer.iteration, "consumed_samples": trainer.consumed_samples,
        "skipped_iterations": trainer.skipped_iterations, "nan_iterations": trainer.nan_iterations,
        "loss_scaler": trainer.loss_scaler.state_dict(), "optimizer_steps": optimizer_steps(trainer.optimizer),
        "layout": _layout(trainer),
    }
    state[f"rng.{global_rank()}"] = _rng_state(trainer)  # one per rank: keys differ, so DCP keeps all
    return state


class Checkpointer:
    """Loads at the start of a run; saves and stops it when due."""

    def __init__(self, config: RunConfig, device: torch.device):
        self.config, self.options, self.train = config, config.checkpoint, config.train
        self.device = device
        self.last_saved: int | None = None
        # The tokenizer's files are looked for now (a missing one fails the run before it starts);
        # the first save copies them.
        self._copies_tokenizer = bool(self.options.save and tokenizer_files(config.data))
        self._saved_config: dict | None = None   # config.yaml's content, naming the tokenizer's copies
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
        start = time.perf_counter()
        directory = iteration_dir(self.options.save, trainer.iteration)
        trainer.optimizer.wait_for_parameters()   # --overlap-param-gather: weights still arriving
        state = training_state(trainer)
        self.last_saved = trainer.iteration
        made_for = self._compiled_for(trainer)
        if made_for is not None:
            compile_artifacts.save(directory, global_rank(), made_for)
        # WRITE_THREADS read here, at each save: bench/checkpoint.py sets this module's to compare counts
        args = dict(config=self._run_config(), keep_last=self.options.keep_last, thread_count=WRITE_THREADS)
        if not self.options.async_save:
            size = write_checkpoint(directory, state, group=None, **args)
            self._report(trainer.iteration, directory, size, time.perf_counter() - start)
            return
        self.wait()   # the previous write is done with the staging buffers
        staged = self._stage(state)
        blocked = time.perf_counter() - start
        self._writer = threading.Thread(target=self._write_in_background,
                                        args=(directory, staged, args, trainer.iteration, start, blocked))
        self._writer.start()

    def _run_config(self) -> dict:
        """config.yaml's content: the run's configuration, its tokenizer paths naming the copies in
        --save (made by rank 0 at the first save), and the paths of the model it started from made
        absolute (LoRA's adapters are read with that base: tessera.posttrain.lora_checkpoint)."""
        if self._saved_config is None:
            config = self.config.to_dict()
            if self._copies_tokenizer:
                paths = copy_tokenizer(self.config.data, Path(self.options.save)) if global_rank() == 0 else {}
                config["data"].update(paths)
            for name in ("pretrained_checkpoint", "load"):
                if config["checkpoint"][name]:
                    config["checkpoint"][name] = str(Path(config["checkpoint"][name]).resolve())
            self._saved_config = config
        return self._saved_config

    @staticmethod
    def _report(iteration: int, directory: Path, size: int, seconds: float, written: float | None = None) -> None:
        """Megatron's line after a save, with its size on disk (GB; MB below 0.1 GB); for an async save
        `seconds` is the time training was blocked and `written` the time to disk."""
        how = "" if written is None else f" (async save: the time training was blocked; written in {written:.2f} s)"
        size_text = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"
        log_info(f"saved checkpoint at iteration {iteration} to {directory} in {seconds:.2f} s{how} ({size_text})")

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

    def _write_in_background(self, directory: Path, state: dict, args: dict, iteration: int, start: float,
                             blocked: float) -> None:
        try:
            size = write_checkpoint(directory, state, group=self._group, **args)
            self._report(iteration, directory, size, blocked, written=time.perf_counter() - start)
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

    def load(self, trainer, on_start_weights: Callable[[], None] | None = None) -> None:
        """Resume from the newest readable checkpoint in --load; with none there (or with
        --finetune), start from the weights of --pretrained-checkpoint or --load's, or from scratch.

        Under LoRA the base is always --pretrained-checkpoint's (checkpoints hold the adapters) and
        loads first. `on_start_weights` is called once the run's start weights are in the model,
        before a resume replaces them (DPO's reference pass, GRPO's frozen reference)."""
        resuming = self._resuming()
        pretrained = self.options.pretrained_checkpoint is not None
        if pretrained and (self.config.posttrain.lora or on_start_weights is not None or not resuming):
            self._load_pretrained(trainer)
        elif resuming and on_start_weights is not None:
            raise ConfigError(f"resuming from --load {self.options.load} needs --pretrained-checkpoint: the run's "
                              "start weights (the DPO or GRPO reference) are not in its checkpoints")
        if self.options.load is not None and not resuming:
            self._resume(trainer)   # --finetune's weights, or none yet: says so
        if on_start_weights is not None:
            on_start_weights()
        if resuming:
            self._resume(trainer)

    def _resuming(self) -> bool:
        """Whether --load holds a checkpoint to resume (without --finetune, which starts over)."""
        load = self.options.load
        return load is not None and not self.options.finetune and Path(load).is_dir() and \
            bool(complete_checkpoints(load, warn=lambda message: None))

    def _load_pretrained(self, trainer) -> None:
        """--pretrained-checkpoint's weights at iteration 0 (tessera.training.pretrained)."""
        path = self.options.pretrained_checkpoint
        if is_hf_dir(path):
            converted = converted_checkpoint(path, self.config.model.make_vocab_size_divisible_by)
            try:
                self._load_from(complete_checkpoints(converted)[0], trainer, weights_only=True)
            finally:
                remove_converted(converted)
        else:
            self._load_from(newest_checkpoint(path, "--pretrained-checkpoint"), trainer, weights_only=True)
        log_info(f"starting from the weights of --pretrained-checkpoint {path}")

    def _model_state_in(self, model, metadata: dict, directory: Path) -> dict[str, Any]:
        """What of the model `directory` holds: all of it; a base model (no LoRA adapters in it,
        they start fresh); or, under LoRA, the adapters (the base was loaded from
        --pretrained-checkpoint)."""
        from tessera.posttrain.lora import is_adapter_parameter

        state = model_state(model)
        if not self.config.posttrain.lora and any(is_adapter_parameter(key) for key in metadata):
            raise ConfigError(f"{directory} holds LoRA adapters: train them with the checkpoint's --lora-rank and "
                              "--lora-alpha (its config.yaml), or merge them first (tessera convert tessera-to-hf)")
        frozen = {f"model.{name}" for name, param in model.named_parameters() if not param.requires_grad}
        if any(key in frozen and key not in metadata for key in state) and \
                self.options.pretrained_checkpoint is None:
            raise ConfigError(f"{directory} holds LoRA adapters without their base model: give the base with "
                              "--pretrained-checkpoint")
        return {key: value for key, value in state.items()
                if key in metadata or not (key in frozen or is_adapter_parameter(key))}

    def _resume(self, trainer) -> bool:
        """Load the newest readable checkpoint in --load; False when it holds none."""
        root = Path(self.options.load)
        fallback = "the weights of --pretrained-checkpoint" if self.options.pretrained_checkpoint else "scratch"
        # Megatron's auto-resume: `--save $CKPT --load $CKPT` on every launch of a job, the first one included.
        first_launch = self.options.save is not None and Path(self.options.save).resolve() == root.resolve()
        if root.exists() and not root.is_dir():
            raise ConfigError(f"--load {root}: not a directory")
        if not root.exists() and not first_launch:
            raise ConfigError(f"--load {root}: no such directory (to resume a job from its first launch on, "
                              "give --save the same directory)")
        candidates = complete_checkpoints(root)
        if not candidates:
            if (root / ".metadata").is_file():
                raise ConfigError(f"--load {root}: this is one checkpoint; --load takes the directory that holds "
                                  f"them ({root.parent})")
            if first_launch:
                log_info(f"--load {root}: no checkpoint yet (the --save directory), starting from {fallback}")
            else:
                log_warning(f"--load {root}: no checkpoint in it, starting from {fallback}")
            return False
        for directory in candidates:
            try:
                self._load_from(directory, trainer)
                log_info(f"loaded {directory} (iteration {trainer.iteration})")
                return True
            except ConfigError:
                raise
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- corrupt: fall back to an older one
                log_warning(f"skipping {directory}: cannot be read ({type(exc).__name__}: {str(exc)[:300]})")
        raise RuntimeError(f"--load {root}: none of its checkpoints could be read")

    def _compiled_for(self, trainer) -> dict | None:
        """What this rank's compiled kernels were made for (tessera.training.compile_artifacts), or
        None where no artifacts are kept: nothing compiled, --no-compile-artifacts, torch < 2.7."""
        if not trainer.compiled or self.train.compile_artifacts is False or not compile_artifacts.supported():
            return None
        return compile_artifacts.fingerprint(self.config, trainer.mesh, self.device)

    def _load_from(self, directory: Path, trainer, weights_only: bool = False) -> None:
        made_for = self._compiled_for(trainer)   # the kernels first: nothing has compiled yet
        note = compile_artifacts.load(directory, global_rank(), made_for) if made_for is not None else None
        if note is not None:
            log_warning(note)
        saved = saved_run_config(directory)
        differences = model_config_differences(saved["model"], self.config.model)
        if differences:
            raise ConfigError(f"{directory} was saved for another model; differing settings:\n  "
                              + "\n  ".join(differences))
        metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
        weights_only = weights_only or self.options.finetune or "train_state" not in metadata
        state: dict[str, Any] = self._model_state_in(trainer.model, metadata, directory)
        if not (weights_only or self.options.no_load_optim):
            state.update(optimizer_state(trainer.model, trainer.optimizer, create=True))
        _check_tensors(state, metadata, directory)
        if not weights_only:
            state["train_state"] = None
            state.update(fp8_scaling_targets(trainer.model, metadata))
        rng_key = f"rng.{global_rank()}"
        if not (weights_only or self.options.no_load_rng) and rng_key in metadata:
            state[rng_key] = None
        with single_process_ok():
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory), planner=LoadPlanner())
        # Delayed scaling's scales first: storing the masters casts the weights that
        # --fp8-param-gather gathers in E4M3, with these scales.
        missing = [] if weights_only else restore_fp8_scaling(trainer.model, state)
        trainer.optimizer.cast_fp8_shards()   # FSDP2's E4M3 shards, from the weights just loaded
        masters = master_weights(trainer.optimizer)
        if masters:  # fp32 masters read from the same (fp32) weights, not from the bf16 copy
            stored = {key: value for key, value in master_state(trainer.model, masters).items() if key in metadata}
            with single_process_ok():   # (a base model's checkpoint has no LoRA adapters: theirs stay)
                dcp.load(stored, storage_reader=dcp.FileSystemReader(directory), planner=LoadPlanner())
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
            log_warning(f"{directory} has no FP8 delayed-scaling state for {len(missing)} layers (e.g. {missing[0]}): "
                  "their amax histories start fresh")
        self.last_saved = trainer.iteration
        if rng_key in state and train_state["layout"] == _layout(trainer):
            _set_rng_state(trainer, state[rng_key])
        elif not self.options.no_load_rng:
            log_warning(f"random states not restored: saved with layout {train_state['layout']}, "
                  f"now {_layout(trainer)} (dropout masks will differ from the original run)")

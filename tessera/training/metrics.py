"""Throughput and MFU, and where metrics go: the console line, --log-json, TensorBoard.

TFLOP/s/GPU = model FLOPs of one iteration (tessera.perf.flops, Megatron's formula) /
(seconds per iteration x number of GPUs), as Megatron-LM reports it. MFU divides that by
the GPU's dense peak for the training dtype (tessera.perf.hardware), or by --peak-tflops.
The FLOPs are fixed per iteration, except with packed documents, where the attention term
follows the documents of the logged iterations (`IterationStats.flops_per_iteration`).
"""

from __future__ import annotations

import datetime
import json
import math
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.config import ConfigError
from tessera.perf.hardware import detect_gpu


def resolve_peak_tflops(override: float | None, device: torch.device, dtype_name: str) -> float | None:
    """Peak TFLOP/s per GPU for MFU: --peak-tflops, else the detected GPU's, else None (CPU)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    gpu = detect_gpu(torch.cuda.get_device_name(device))
    if gpu is None:
        return None
    if dtype_name == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype_name = "tf32"
    return gpu.peak_tflops.get(dtype_name)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is in KiB on Linux: the process's peak resident memory.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@dataclass
class IterationStats:
    """What one log line reports, averaged over the log interval where that makes sense."""

    iteration: int
    train_iters: int
    consumed_samples: int
    seconds_per_iteration: float
    loss: float | None          # None: every iteration of the interval was skipped (fp16 overflow)
    lr: float
    grad_norm: float | None     # the last iteration's; None when it was skipped
    loss_scale: float
    skipped_iterations: int
    nan_iterations: int
    mem_gb: float
    moe: dict[str, float] = field(default_factory=dict)   # MoE losses and load imbalance, by name
    terms: dict[str, float] = field(default_factory=dict)   # MTP depths' losses ("mtp_1 loss"), DPO's rewards, ...
    flops_per_iteration: float | None = None   # when the data decides them (packed documents); else the writer's
    decoupled_lr: float | None = None   # --decoupled-lr's current rate


class MetricsWriter:
    """Formats and writes the metrics of a run; every method is a no-op off rank 0."""

    def __init__(self, *, flops_per_iteration: float, tokens_per_iteration: int, num_gpus: int,
                 global_batch_size: int, peak_tflops: float | None, log_json: str | None,
                 tensorboard_dir: str | None, enabled: bool = True):
        self.flops_per_iteration = flops_per_iteration
        self.tokens_per_iteration = tokens_per_iteration
        self.num_gpus, self.global_batch_size, self.peak_tflops = num_gpus, global_batch_size, peak_tflops
        self.enabled = enabled
        self.json_path = Path(log_json) if log_json and enabled else None
        self.tensorboard = _tensorboard_writer(tensorboard_dir) if tensorboard_dir and enabled else None

    def throughput(self, seconds_per_iteration: float, flops_per_iteration: float | None = None
                   ) -> dict[str, float | None]:
        flops = self.flops_per_iteration if flops_per_iteration is None else flops_per_iteration
        tflops = flops / (seconds_per_iteration * self.num_gpus) / 1e12
        return {
            "tokens_per_sec": self.tokens_per_iteration / seconds_per_iteration,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
        }

    def log_iteration(self, stats: IterationStats) -> None:
        if not self.enabled:
            return
        speed = self.throughput(stats.seconds_per_iteration, stats.flops_per_iteration)
        record = {
            "iteration": stats.iteration, "consumed_samples": stats.consumed_samples, "loss": stats.loss,
            "lr": stats.lr, **({} if stats.decoupled_lr is None else {"decoupled_lr": stats.decoupled_lr}),
            "grad_norm": stats.grad_norm, "loss_scale": stats.loss_scale,
            "skipped_iterations": stats.skipped_iterations, "nan_iterations": stats.nan_iterations,
            "iteration_time_ms": stats.seconds_per_iteration * 1e3, **speed, "mem_gb": stats.mem_gb,
            **{name.replace(" ", "_"): value for name, value in {**stats.terms, **stats.moe}.items()},
        }
        remaining = (stats.train_iters - stats.iteration) * stats.seconds_per_iteration
        mfu = f"{speed['mfu'] * 100:.1f}%" if speed["mfu"] is not None else "n/a"
        fields = [
            f"iteration {stats.iteration:8d}/{stats.train_iters:8d}",
            f"consumed samples: {stats.consumed_samples:12d}",
            f"elapsed time per iteration (ms): {stats.seconds_per_iteration * 1e3:.1f}",
            f"throughput per GPU (TFLOP/s/GPU): {speed['tflops_per_gpu']:.4g}",
            f"MFU: {mfu}",
            f"tokens/s: {speed['tokens_per_sec']:.0f}",
            f"learning rate: {stats.lr:.6E}",
            *([] if stats.decoupled_lr is None else [f"decoupled learning rate: {stats.decoupled_lr:.6E}"]),
            f"global batch size: {self.global_batch_size:5d}",
            f"lm loss: {_or_skipped(stats.loss, '.6E')}",
            *(f"{name}: {value:.6E}" for name, value in stats.terms.items()),
            *(f"{name}: {value:.6E}" if "imbalance" not in name else f"{name}: {value:.3f}"
              for name, value in stats.moe.items()),
            f"loss scale: {stats.loss_scale:.6g}",
            f"grad norm: {_or_skipped(stats.grad_norm, '.3f')}",
            f"number of skipped iterations: {stats.skipped_iterations:3d}",
            f"number of nan iterations: {stats.nan_iterations:3d}",
            f"mem: {stats.mem_gb:.2f} GB",
            f"ETA {datetime.timedelta(seconds=round(remaining))}",
        ]
        print(f" [{_now()}] " + " | ".join(fields) + " |", flush=True)
        self._write(record, stats.iteration)

    def log_eval(self, iteration: int, eval_loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(eval_loss, 20.0))
        print(f" [{_now()}] validation loss at iteration {iteration} | lm loss value: {eval_loss:.6E} "
              f"| lm loss PPL: {ppl:.6E} |", flush=True)
        self._write({"iteration": iteration, "eval_loss": eval_loss, "eval_ppl": ppl}, iteration)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _write(self, record: dict, iteration: int) -> None:
        if self.json_path is not None:
            with self.json_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, iteration)


def _or_skipped(value: float | None, spec: str) -> str:
    return "skipped" if value is None else format(value, spec)


def _now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def _tensorboard_writer(path: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter(log_dir=path)

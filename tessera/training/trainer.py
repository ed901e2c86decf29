"""The training loop: micro-batches accumulated into a global batch, one optimizer step each.

The trainer is the one place that composes the model, data, optimizer, precision and
metrics (DESIGN.md). One iteration:

    for each micro-batch: forward -> per-token loss -> backward (loss summed, / tokens in the batch)
    unscale + global grad norm -> skip on overflow, else clip -> AdamW step at the scheduled LR

The loss of an iteration is the mean over every unmasked token of the global batch, so
it does not depend on how the batch is cut into micro-batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from tessera.config import RunConfig
from tessera.data.mock import MockGPTDataset
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.perf.flops import count_parameters, flops_per_iteration
from tessera.training.metrics import IterationStats, MetricsWriter, peak_memory_gb, resolve_peak_tflops
from tessera.training.optimizer import build_optimizer, fused_step, grad_norm, set_learning_rate
from tessera.training.precision import LossScaler, autocast, autocast_dtype
from tessera.training.schedules import LRSchedule

Batch = dict[str, torch.Tensor]


@dataclass
class StepResult:
    """One iteration's outcome. Fields are 0-d device tensors until `resolve()`, so that a
    step never waits for the GPU; the log reads them once per --log-interval."""

    loss: torch.Tensor | float
    grad_norm: torch.Tensor | float
    skipped: torch.Tensor | bool

    def resolve(self) -> "StepResult":
        loss, norm, skipped = torch.stack([self.loss, self.grad_norm, self.skipped.float()]).tolist()
        return StepResult(loss, norm, bool(skipped))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    return torch.device(name)


class Trainer:
    def __init__(self, config: RunConfig):
        self.config = config
        model_cfg, train = config.model, config.train
        self.device = resolve_device(train.device)
        torch.manual_seed(train.seed)
        recompute = Recompute(train.recompute_granularity, train.recompute_method, train.recompute_num_layers)
        with torch.device(self.device):
            self.model = GPTModel(model_cfg, recompute=recompute)
        initialize_parameters(self.model, train.seed)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.lr_schedule = LRSchedule(config.optim, train.train_iters)
        self.loss_scaler = LossScaler(train)
        self.amp_dtype = autocast_dtype(train)
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped_iterations = 0
        self.nan_iterations = 0
        if train.compile if train.compile is not None else self.device.type == "cuda":
            self._compile()
        self._attention = _attention_backend(train.attention_backend, self.device)
        self.train_data = self._batches("train")
        self.valid_data = self._batches("valid") if train.eval_interval else None
        self.metrics = MetricsWriter(
            flops_per_iteration=flops_per_iteration(model_cfg, train.global_batch_size, model_cfg.seq_length,
                                                    self.model.vocab_size),
            tokens_per_iteration=train.global_batch_size * model_cfg.seq_length,
            num_gpus=config.world_size, global_batch_size=train.global_batch_size,
            peak_tflops=resolve_peak_tflops(train.peak_tflops, self.device, train.dtype_name),
            log_json=train.log_json, tensorboard_dir=train.tensorboard_dir,
        )

    # -- setup -------------------------------------------------------------------------

    def _compile(self) -> None:
        """Compile each block and the output head separately: small graphs compile fast
        and every block reuses the first one's kernels."""
        for layer in self.model.layers:
            layer.compile()
        self.model.head = torch.compile(self.model.head)  # instance attribute shadows the method

    def _batches(self, split: str) -> Iterator[Batch]:
        cfg, train = self.config, self.config.train
        if not cfg.data.mock_data:
            raise SystemExit("tessera train: error: no data given; use --mock-data")
        samples = train.train_iters * train.global_batch_size
        if split == "valid":
            samples = (train.train_iters // train.eval_interval + 1) * train.eval_iters * train.global_batch_size
        seed = train.seed if split == "train" else train.seed + 1
        dataset = MockGPTDataset(samples, cfg.model.seq_length, cfg.model.vocab_size, seed)
        return _micro_batches(dataset, train.micro_batch_size, rank=0, size=cfg.data_parallel_size)

    # -- one iteration -----------------------------------------------------------------

    def _forward(self, batch: Batch) -> torch.Tensor:
        """Sum of the masked per-token losses of one micro-batch."""
        with autocast(self.device.type, self.amp_dtype):
            losses = self.model(batch["tokens"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                                attention_mask=batch.get("attention_mask"))
        return (losses * batch["loss_mask"]).sum()

    def train_step(self) -> StepResult:
        self.model.train()
        micro_batches = [self._to_device(next(self.train_data)) for _ in range(self.config.num_micro_batches)]
        num_tokens = sum(b["loss_mask"].sum() for b in micro_batches).clamp(min=1)
        scale = self.loss_scaler.scale
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro_batches:
            loss = self._forward(batch)
            (loss * (scale / num_tokens)).backward()
            loss_sum += loss.detach()
        norm = grad_norm(list(self.model.parameters()))
        if self.loss_scaler.dynamic:  # the scale of the next iteration depends on this one
            self.loss_scaler.update(not torch.isfinite(norm).item())
        set_learning_rate(self.optimizer, self.lr_schedule(self.iteration))
        norm = fused_step(self.optimizer, norm, scale, self.config.optim.clip_grad)
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        self.consumed_samples += self.config.train.global_batch_size
        return StepResult(loss_sum / num_tokens, norm, self.optimizer.found_inf > 0)

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total, tokens = 0.0, 0.0
        for _ in range(self.config.train.eval_iters * self.config.num_micro_batches):
            batch = self._to_device(next(self.valid_data))
            total += self._forward(batch).item()
            tokens += batch["loss_mask"].sum().item()
        return total / max(tokens, 1.0)

    # -- the loop ----------------------------------------------------------------------

    def train(self) -> list[StepResult]:
        """Run to --train-iters (or --exit-interval); returns every iteration's resolved result."""
        train = self.config.train
        self._log_start()
        history: list[StepResult] = []
        pending: list[StepResult] = []
        interval_start = time.perf_counter()
        with self._attention:
            while self.iteration < train.train_iters:
                pending.append(self.train_step())
                if self.iteration % train.log_interval == 0 or self.iteration == train.train_iters:
                    self._synchronize()
                    seconds = (time.perf_counter() - interval_start) / len(pending)
                    results = [r.resolve() for r in pending]
                    self._log(results, seconds)
                    history += results
                    pending, interval_start = [], time.perf_counter()
                if train.eval_interval and (self.iteration % train.eval_interval == 0
                                            or self.iteration == train.train_iters):
                    self.metrics.log_eval(self.iteration, self.evaluate())
                    interval_start = time.perf_counter()  # evaluation is not training time
                if train.exit_interval and self.iteration % train.exit_interval == 0:
                    self.metrics.info(f"exiting at iteration {self.iteration} (--exit-interval)")
                    break
        history += [r.resolve() for r in pending]
        self.metrics.close()
        return history

    def _log(self, results: list[StepResult], seconds_per_iteration: float) -> None:
        for result in results:
            if result.skipped:
                self.skipped_iterations += 1
                if not math.isfinite(result.grad_norm) and not self.config.train.fp16:
                    self.nan_iterations += 1
        losses = [r.loss for r in results if not r.skipped]
        self.metrics.log_iteration(IterationStats(
            iteration=self.iteration, train_iters=self.config.train.train_iters,
            consumed_samples=self.consumed_samples, seconds_per_iteration=seconds_per_iteration,
            loss=sum(losses) / len(losses) if losses else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"], grad_norm=results[-1].grad_norm,
            loss_scale=self.loss_scaler.scale, skipped_iterations=self.skipped_iterations,
            nan_iterations=self.nan_iterations, mem_gb=peak_memory_gb(self.device),
        ))

    def _log_start(self) -> None:
        cfg = self.config
        params = count_parameters(cfg.model, self.model.vocab_size)
        self.metrics.info(
            f"tessera: {params.total / 1e6:.1f}M parameters ({params.non_embedding / 1e6:.1f}M non-embedding) | "
            f"device {self.device} | {cfg.train.dtype_name} | global batch {cfg.train.global_batch_size} = "
            f"{cfg.num_micro_batches} micro-batches x {cfg.train.micro_batch_size} x DP {cfg.data_parallel_size} "
            f"| seq {cfg.model.seq_length}"
        )

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _micro_batches(dataset, micro_batch_size: int, rank: int, size: int) -> Iterator[Batch]:
    """Consecutive micro-batches of this data-parallel rank, Megatron's sequential order."""
    start = 0
    while True:
        first = start + rank * micro_batch_size
        samples = [dataset[(first + i) % len(dataset)] for i in range(micro_batch_size)]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        start += micro_batch_size * size


def _attention_backend(name: str, device: torch.device):
    """Context that orders SDPA kernels. On H100/H200, cuDNN attention is 1.6-1.8x faster
    than FlashAttention-2 (shared/anchors/NOTES.md), so 'auto' tries it first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda":
        return contextlib.nullcontext()
    order = {
        "auto": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH],
        "cudnn": [SDPBackend.CUDNN_ATTENTION], "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH],
    }[name]
    return sdpa_kernel(order, set_priority=name == "auto")

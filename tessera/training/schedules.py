"""Learning-rate schedules with linear warmup (Megatron-LM's OptimizerParamScheduler semantics).

`learning_rate(step)` is a pure function of the number of optimizer steps already taken,
so a resumed run recomputes the same value without saved scheduler state.
"""

from __future__ import annotations

import math

from tessera.config import OptimConfig, TrainConfig


class LRSchedule:
    def __init__(self, optim: OptimConfig, train: TrainConfig):
        self.max_lr, self.min_lr, self.init_lr = optim.lr, optim.min_lr, optim.lr_warmup_init
        self.decoupled_max_lr = optim.decoupled_lr
        self.decoupled_min_lr = optim.min_lr if optim.decoupled_min_lr is None else optim.decoupled_min_lr
        self.style = optim.lr_decay_style
        self.wsd_style = optim.lr_wsd_decay_style
        if train.train_samples is None:
            self.decay_iters = optim.lr_decay_iters or train.train_iters
            self.wsd_iters = optim.lr_wsd_decay_iters
            self.warmup_iters = optim.lr_warmup_iters
            if optim.lr_warmup_fraction is not None:
                self.warmup_iters = int(optim.lr_warmup_fraction * self.decay_iters)
            return
        # Sample-based (--train-samples): Megatron-LM's scheduler counts samples, a global batch per
        # step, which is the same schedule over fractional iterations.
        batch = train.global_batch_size
        self.decay_iters = (optim.lr_decay_samples or train.train_samples) / batch
        self.wsd_iters = optim.lr_wsd_decay_samples / batch if optim.lr_wsd_decay_samples else None
        self.warmup_iters = optim.lr_warmup_samples / batch
        if optim.lr_warmup_fraction is not None:
            self.warmup_iters = optim.lr_warmup_fraction * self.decay_iters

    def __call__(self, step: int) -> float:
        return self._rate(step, self.max_lr, self.min_lr)

    def decoupled(self, step: int) -> float | None:
        """--decoupled-lr's rate: the same schedule between its own peak and floor (Megatron-LM's
        per-group max_lr/min_lr); None without it."""
        if self.decoupled_max_lr is None:
            return None
        return self._rate(step, self.decoupled_max_lr, self.decoupled_min_lr)

    def _rate(self, step: int, max_lr: float, min_lr: float) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.init_lr + (max_lr - self.init_lr) * step / self.warmup_iters
        if self.style == "constant":
            return max_lr
        if self.style == "inverse-square-root":
            warmup, step = max(self.warmup_iters, 1), max(step, 1)
            return max(min_lr, max_lr * math.sqrt(warmup) / math.sqrt(step))
        if step > self.decay_iters:
            return min_lr
        ratio = (step - self.warmup_iters) / max(self.decay_iters - self.warmup_iters, 1)
        if self.style == "linear":
            coeff = 1.0 - ratio
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: warmup, stable at max_lr, then decay over the last wsd_iters iterations
            anneal_start = self.decay_iters - self.wsd_iters
            if step <= anneal_start:
                coeff = 1.0
            else:
                coeff = self._wsd_coeff((step - anneal_start) / self.wsd_iters)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, ratio: float) -> float:
        if self.wsd_style == "linear":
            return 1.0 - ratio
        if self.wsd_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        return 2.0 * 0.5**ratio - 1.0  # exponential: 1 at the start of decay, 0 at its end

"""Mixed precision: the autocast dtype and fp16 loss scaling.

Parameters stay fp32 (they are the master weights); forward and backward GEMMs run in
bf16/fp16 under autocast. fp16 needs loss scaling so that small gradients do not flush
to zero; the scaler below follows Megatron-LM's dynamic scaler (hysteresis included,
which torch.amp.GradScaler lacks): an overflowing iteration is skipped, and after
`hysteresis` overflows the scale halves; after `window` clean iterations it doubles.
"""

from __future__ import annotations

import contextlib

import torch

from tessera.config import TrainConfig


def autocast_dtype(train: TrainConfig) -> torch.dtype | None:
    return torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else None


def autocast(device_type: str, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


class LossScaler:
    """Constant (static or 1.0) or dynamic loss scale."""

    def __init__(self, train: TrainConfig):
        self.dynamic = train.fp16 and train.loss_scale is None
        self.scale = train.loss_scale if train.loss_scale is not None else (
            train.initial_loss_scale if train.fp16 else 1.0)
        self.min_scale, self.window, self.hysteresis = train.min_loss_scale, train.loss_scale_window, train.hysteresis
        self._hysteresis_left = self.hysteresis
        self._clean_iterations = 0

    def update(self, found_overflow: bool) -> None:
        if not self.dynamic:
            return
        if found_overflow:
            self._clean_iterations = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self._clean_iterations += 1
            if self._clean_iterations == self.window:
                self.scale *= 2.0
                self._clean_iterations = 0
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "clean_iterations": self._clean_iterations}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._clean_iterations = state["clean_iterations"]

"""--check-for-nan-in-loss-and-grad: stop the run at the first NaN/Inf loss or gradient norm.

The optimizer already refuses a non-finite update inside its fused kernel (its step is
conditional on a finite global norm), so nothing bad is ever applied; this check turns
such an iteration into a clear error. On a GPU, reading the values at once would stall
the host on every step; instead each iteration's values are copied to pinned memory
behind a CUDA event and read one iteration later, when the event has long completed, so
the run stops one iteration later than the bad one and never waits for the GPU.
"""

from __future__ import annotations

import torch


class NonFiniteCheck:
    def __init__(self, device: torch.device, *, check_grads: bool):
        self.device, self.check_grads = device, check_grads
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None

    def watch(self, iteration: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record iteration `iteration`'s values; raise if an earlier one was not finite."""
        values = [loss, grad_norm] if self.check_grads else [loss]
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device) for v in values]).detach()
        if self.device.type != "cuda":
            self._raise_if_bad(iteration, values)
            return
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        previous, self._pending = self._pending, (iteration, host, event)
        if previous is not None:
            self.check(previous)

    def flush(self) -> None:
        """Check the last recorded iteration (at the end of training)."""
        if self._pending is not None:
            self.check(self._pending)
            self._pending = None

    def check(self, pending) -> None:
        iteration, host, event = pending
        event.synchronize()
        self._raise_if_bad(iteration, host)

    def _raise_if_bad(self, iteration: int, values: torch.Tensor) -> None:
        if not torch.isfinite(values).all():
            raise FloatingPointError(
                f"NaN or Inf in the loss or gradients at iteration {iteration} (loss {values[0].item()}"
                + (f", grad norm {values[1].item()}" if self.check_grads else "")
                + "); the update was not applied. --no-check-for-nan-in-loss-and-grad skips such iterations "
                "instead of stopping")

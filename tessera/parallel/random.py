"""Dropout randomness under tensor parallelism (Megatron's "model-parallel RNG tracker").

Two streams, and which one a dropout draws from decides whether its masks agree over
the ranks of a tensor-parallel (TP) group:

- the default generator, seeded alike on every TP rank and advanced by the same calls,
  gives every rank the same mask. Dropout on replicated activations (the residual
  stream without sequence parallelism) must use it: the ranks hold the same tensor.
- `DropoutRNG`, seeded per TP rank, gives each rank its own mask. Dropout on split
  activations must use it: attention probabilities of the rank's own heads, and under
  sequence parallelism the residual stream of the rank's own tokens. Drawing the same
  mask for every shard would correlate the dropout of different heads or tokens.

`DropoutRNG.fork()` swaps its state into the device's default generator for the
duration of a block, so fused kernels (SDPA's dropout) use it without a generator
argument. Activation recomputation must replay the same masks: `checkpoint` restores
the stream's state for the recomputation as torch.utils.checkpoint does for the default one.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as torch_checkpoint

# Megatron's offset between the default seed and the tensor-parallel dropout seed.
TP_SEED_OFFSET = 2718


def _default_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_default_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class DropoutRNG:
    """A random stream of its own per TP rank, for dropout on tensor-parallel shards."""

    def __init__(self, seed: int, tp_rank: int = 0):
        self.seed = seed + TP_SEED_OFFSET + tp_rank
        self._states: dict[str, torch.Tensor] = {}  # per device; created on first use

    @contextmanager
    def fork(self, device: torch.device):
        """Draw random numbers on `device` from this stream instead of the default one."""
        key = str(device)
        if key not in self._states:
            self._states[key] = torch.Generator(device).manual_seed(self.seed).get_state()
        default = _default_state(device)
        _set_default_state(self._states[key], device)
        try:
            yield
        finally:
            self._states[key] = _default_state(device)
            _set_default_state(default, device)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "states": dict(self._states)}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self._states = state["seed"], dict(state["states"])

    def _replay_contexts(self):
        """(forward, recompute) contexts for torch.utils.checkpoint: the recomputation
        starts from the stream's state at the start of the forward, and leaves it as it was."""
        saved: dict[str, torch.Tensor] = {}

        @contextmanager
        def forward():
            saved.update(self._states)  # state tensors are replaced, never changed in place
            yield

        @contextmanager
        def recompute():
            current, self._states = self._states, dict(saved)
            try:
                yield
            finally:
                self._states = current

        return forward(), recompute()


def dropout(x: torch.Tensor, p: float, training: bool, rng: DropoutRNG | None = None) -> torch.Tensor:
    """F.dropout with the mask drawn from `rng` (None: the default generator)."""
    if p == 0 or not training:  # skipped outright: a no-op dropout still costs a kernel
        return x
    with rng.fork(x.device) if rng is not None else nullcontext():
        return F.dropout(x, p, training=True)


def checkpoint(fn, *args, rng: DropoutRNG | None = None, replay=None):
    """Activation checkpointing (non-reentrant) that also replays `rng`'s stream.

    `replay`, a context-manager factory, is entered around the recomputation only (MoE
    routers use it not to count their tokens twice). Pass `rng=None` when `fn` draws
    nothing from it: torch.compile traces the plain checkpoint but not one with replay contexts.
    """
    if rng is None and replay is None:
        return torch_checkpoint(fn, *args, use_reentrant=False)

    def contexts():
        forward, recompute = rng._replay_contexts() if rng is not None else (nullcontext(), nullcontext())
        return forward, _both(recompute, replay() if replay is not None else nullcontext())

    return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


@contextmanager
def _both(first, second):
    with first, second:
        yield

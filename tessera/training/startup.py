"""Where a run's start-up went, in one line before its first iteration's, so that a user sees
what they wait for: importing (Python, torch, tessera and the flags, from tessera's import to
the trainer), building the model and optimizer, loading (a checkpoint, a pretrained model,
DPO's reference pass), and the first step, which compiles.
"""

from __future__ import annotations

import time

import tessera

_first_run = True   # later trainers of one process imported nothing


class Startup:
    def __init__(self):
        global _first_run
        self._last = time.perf_counter()
        self.seconds = {"import": self._last - tessera.IMPORTED_AT if _first_run else 0.0}
        _first_run = False

    def lap(self, phase: str) -> None:
        """The time since the last lap was `phase`'s."""
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now

    def line(self) -> str:
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.seconds.items())
        return f"start-up took {sum(self.seconds.values()):.1f} s: {phases}"

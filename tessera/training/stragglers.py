"""--log-straggler: name the ranks whose forward-backward is slowest and fastest.

In a synchronous job every rank's iteration takes as long as the slowest rank's, so the
iteration time cannot show which GPU is slow. What differs is the time each rank spends in
its own forward and backward before it waits for the others in the gradient reduction.
That is timed on every rank (CUDA events on GPUs: no host sync inside the step) and
gathered once per --log-interval. Ranks of one tensor- or pipeline-parallel group wait for
each other inside the step, so a slow GPU shows as its whole group being slow.
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist

from tessera.parallel.collectives import all_gather_flat


class StragglerTimer:
    """Times this rank's forward-backward; `report` gathers every rank's (collective)."""

    def __init__(self, device: torch.device, count: int):
        self.device, self.count = device, count
        self.intervals: list[tuple] = []
        self.hosts = [None] * dist.get_world_size() if dist.is_initialized() else [socket.gethostname()]
        if dist.is_initialized():
            dist.all_gather_object(self.hosts, socket.gethostname())

    def _now(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        self.intervals.append((self._start, self._now()))

    def _mean_seconds(self) -> float:
        if self.device.type == "cuda":
            seconds = [begin.elapsed_time(end) / 1e3 for begin, end in self.intervals]  # the caller synchronised
        else:
            seconds = [end - begin for begin, end in self.intervals]
        self.intervals = []
        return sum(seconds) / max(len(seconds), 1)

    def report(self) -> str:
        """The log line for the intervals since the last report; every rank must call it."""
        mine = torch.tensor([self._mean_seconds()], dtype=torch.float64, device=self.device)
        every = torch.empty(len(self.hosts), dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            all_gather_flat(every, mine, group=None)
        else:
            every.copy_(mine)
        return straggler_line(every.tolist(), self.hosts, self.count)


def straggler_line(seconds: list[float], hosts: list[str], count: int) -> str:
    """' straggler: forward-backward ms/iteration, slowest rank 5 (node2) 812.0 | fastest ... | max/min 1.29'."""
    order = sorted(range(len(seconds)), key=lambda r: seconds[r])

    def ranks(chosen: list[int]) -> str:
        return ", ".join(f"rank {r} ({hosts[r]}) {seconds[r] * 1e3:.1f}" for r in chosen)

    count = min(count, len(seconds))
    ratio = seconds[order[-1]] / seconds[order[0]] if seconds[order[0]] > 0 else float("inf")
    return (f" straggler: forward-backward ms/iteration, slowest {ranks(order[::-1][:count])} | "
            f"fastest {ranks(order[:count])} | max/min {ratio:.2f}")

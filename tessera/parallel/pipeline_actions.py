"""A pipeline schedule as data: each rank's ordered actions (forward and backward passes of
one micro-batch through one model chunk, and the transfers between neighbouring ranks).
tessera.parallel.pipeline_schedules makes them, tessera.parallel.pipeline_simulation checks
them and tessera.parallel.pipeline runs them. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

FORWARD, BACKWARD = "F", "B"
SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRAD, RECV_GRAD = "send_act", "recv_act", "send_grad", "recv_grad"


@dataclass(frozen=True)
class Action:
    kind: str            # FORWARD, BACKWARD, or one of the four transfers
    micro_batch: int
    chunk: int           # the local model chunk the compute (or the transferred tensor) belongs to
    peer: int | None = None  # pipeline rank at the other end of a transfer

    @property
    def is_compute(self) -> bool:
        return self.kind in (FORWARD, BACKWARD)

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")
        arrow = "->" if self.kind.startswith("send") else "<-"
        return f"{self.kind}{self.micro_batch}.{self.chunk}{arrow}{self.peer}"


@dataclass(frozen=True)
class Schedule:
    name: str
    pp_size: int
    vp_size: int
    num_micro_batches: int
    forward_only: bool
    ranks: tuple[tuple[Action, ...], ...]   # ranks[pp_rank]: that rank's actions in order
    overlap_p2p: bool = False               # transfers stay in flight across computes

    def steps(self, pp_rank: int) -> Iterator[Action | list[Action]]:
        """The actions of a rank as the runner executes them: a compute action, or a list
        of consecutive transfers posted together as one batch."""
        batch: list[Action] = []
        for action in self.ranks[pp_rank]:
            if action.is_compute:
                if batch:
                    yield batch
                    batch = []
                yield action
            else:
                batch.append(action)
        if batch:
            yield batch

    def last_backwards(self, pp_rank: int) -> set[tuple[int, int]]:
        """(micro_batch, chunk) of the last backward of each chunk on a rank: where the
        data-parallel gradient reduction of that chunk may start."""
        last = {a.chunk: a.micro_batch for a in self.ranks[pp_rank] if a.kind == BACKWARD}
        return {(mb, chunk) for chunk, mb in last.items()}

    def theoretical_bubble(self) -> float:
        """Idle fraction of an ideal pipeline: (p - 1) / (v * m + p - 1)."""
        p, v, m = self.pp_size, self.vp_size, self.num_micro_batches
        return (p - 1) / (v * m + p - 1)

    def format(self) -> str:
        title = (f"{self.name} schedule: {self.pp_size} pipeline ranks x {self.vp_size} chunks, "
                 f"{self.num_micro_batches} micro-batches; theoretical bubble {self.theoretical_bubble():.1%}")
        waits = ("each receive waited on by the compute that consumes it" if self.overlap_p2p
                 else "waited on before the next compute")
        lines = [title, f"  F<mb>.<chunk> forward, B backward, [..] transfers posted together, {waits}"]
        for rank in range(self.pp_size):
            parts = [str(s) if isinstance(s, Action) else "[" + " ".join(map(str, s)) + "]"
                     for s in self.steps(rank)]
            lines.append(f"rank {rank}: " + " ".join(parts))
        return "\n".join(lines)

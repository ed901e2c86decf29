"""Pipelines as data: which layers each stage holds (`stage_layer_ranges`) and, for every
pipeline rank, the ordered list of its actions (`build_schedule`; the types in
tessera.parallel.pipeline_actions). No torch here: the planner (tessera.perf) uses the same
split as the trainer.

An action is a forward or backward pass of one micro-batch through one model chunk, or
a send / receive of an activation or its gradient to a neighbouring rank. One runner
(tessera.parallel.pipeline) executes any list; a new schedule is a new generator here,
and a list can be printed (`tessera train ... --print-schedule`) and checked without a
model (tessera.parallel.pipeline_simulation).

With virtual stages (interleaving) each rank holds `vp_size` chunks: chunk c of rank r
is virtual stage c * pp_size + r, so activations leave the last rank for rank 0 when
they move from one chunk to the next.

Generators first order the compute actions, then `_with_communication` inserts the
transfers: a receive right before the compute that needs it, a send right after the
compute that produced it. The runner posts every run of consecutive transfers as one
batch (send-after-forward together with receive-before-backward, as Megatron pairs
them), and `build_schedule` simulates the result to prove it matches and cannot
deadlock before anything runs.

With `overlap_p2p` (--overlap-p2p-communication) the runner leaves transfers in flight
and waits on a receive only right before the compute that consumes it, and on sends at the
end of the step. Each compute is then its own unit, and where forwards and backwards
alternate a receive moves one compute earlier, so that it arrives while the other kind
runs: Megatron's overlapped order, after F send its output and receive the next forward's
input, after B the same for gradients. Moving receives earlier in a run of forwards too
would deadlock under NCCL (the simulator finds it for interleaving with p = 2: two
receives in one group wait on a rank that waits on them).
"""

from __future__ import annotations

from typing import Iterator

from tessera.config import ConfigError
from tessera.parallel.pipeline_actions import (
    BACKWARD, FORWARD, RECV_ACTIVATION, RECV_GRAD, SEND_ACTIVATION, SEND_GRAD, Action, Schedule,
)
from tessera.parallel.pipeline_simulation import simulate

SCHEDULES = ("1f1b", "gpipe")  # interleaved 1F1B is 1f1b with vp_size > 1


def build_schedule(name: str, pp_size: int, num_micro_batches: int, vp_size: int = 1, *,
                   forward_only: bool = False, overlap_p2p: bool = False) -> Schedule:
    """The schedule `name` ('1f1b' or 'gpipe'; '1f1b' interleaves when vp_size > 1),
    checked by simulation: transfers match across ranks and nothing deadlocks."""
    if name not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {name}: choose one of {', '.join(SCHEDULES)}")
    if pp_size < 1 or num_micro_batches < 1 or vp_size < 1:
        raise ConfigError("pipeline sizes and the number of micro-batches must be positive")
    if vp_size > 1:
        if name != "1f1b":
            raise ConfigError("virtual pipeline stages (--virtual-pipeline-model-parallel-size) need "
                              "--pipeline-schedule 1f1b (interleaved)")
        order = _interleaved(pp_size, vp_size, num_micro_batches, forward_only)
        name = "interleaved-1f1b"
    elif name == "gpipe" or forward_only:
        order = _gpipe(pp_size, num_micro_batches, forward_only)
    else:
        order = _one_forward_one_backward(pp_size, num_micro_batches)
    ranks = tuple(tuple(_with_communication(compute, rank, pp_size, vp_size, overlap_p2p))
                  for rank, compute in enumerate(order))
    schedule = Schedule(name, pp_size, vp_size, num_micro_batches, forward_only, ranks, overlap_p2p)
    simulate(schedule)  # raises on a mismatch or deadlock
    return schedule


def stage_layer_ranges(num_layers: int, pp_size: int, vp_size: int = 1, *, first_stage_layers: int | None = None,
                       last_stage_layers: int | None = None) -> list[range]:
    """Global layer indices of each virtual stage (chunk c of pipeline rank r is stage c * pp_size + r).

    Layers are split evenly, except that --decoder-first-pipeline-num-layers and
    --decoder-last-pipeline-num-layers fix the first and last (virtual) stage's share
    and the others split the rest evenly.
    """
    num_stages = pp_size * vp_size
    sizes = [None] * num_stages
    if first_stage_layers is not None:
        sizes[0] = first_stage_layers
    if last_stage_layers is not None:
        sizes[-1] = last_stage_layers
    fixed = sum(s for s in sizes if s is not None)
    free = sizes.count(None)
    rest = num_layers - fixed
    if rest < 0 or (free and rest % free) or (not free and rest):
        given = [f"{flag} {value}" for flag, value in (("--decoder-first-pipeline-num-layers", first_stage_layers),
                                                      ("--decoder-last-pipeline-num-layers", last_stage_layers))
                 if value is not None]
        raise ConfigError(
            f"--num-layers ({num_layers}) cannot be split over {num_stages} pipeline stages "
            f"(--pipeline-model-parallel-size {pp_size} x virtual stages {vp_size})"
            + (f" with {' and '.join(given)}: the remaining {rest} layers must divide evenly over the other "
               f"{free} stages" if given else ": the layers must divide evenly over the stages"))
    sizes = [s if s is not None else rest // free for s in sizes]
    if min(sizes) < 1:
        raise ConfigError(f"every pipeline stage needs at least one layer; the split gives {sizes}")
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


# -- compute orders: per rank, a list of units (one compute, or a forward-backward pair) --

def _gpipe(pp_size: int, num_micro_batches: int, forward_only: bool) -> list[list[list[Action]]]:
    """All forwards, then all backwards: every micro-batch's activations alive at once."""
    forwards = [[Action(FORWARD, mb, 0)] for mb in range(num_micro_batches)]
    backwards = [] if forward_only else [[Action(BACKWARD, mb, 0)] for mb in range(num_micro_batches)]
    return [forwards + backwards for _ in range(pp_size)]


def _one_forward_one_backward(pp_size: int, num_micro_batches: int) -> list[list[list[Action]]]:
    """1F1B (PipeDream-Flush): rank r runs p - r - 1 warm-up forwards, then alternates one
    forward and one backward, so at most p - r micro-batches are alive on it."""
    order = []
    for rank in range(pp_size):
        warmup = min(pp_size - rank - 1, num_micro_batches)
        units = [[Action(FORWARD, mb, 0)] for mb in range(warmup)]
        for mb in range(num_micro_batches - warmup):
            units += [[Action(FORWARD, warmup + mb, 0)], [Action(BACKWARD, mb, 0)]]
        units += [[Action(BACKWARD, mb, 0)] for mb in range(num_micro_batches - warmup, num_micro_batches)]
        order.append(units)
    return order


def _interleaved(pp_size: int, vp_size: int, num_micro_batches: int, forward_only: bool) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-Core's order).

    Micro-batches go through the chunks in groups of pp_size: forward order is group 0
    through chunk 0, group 0 through chunk 1, ..., then group 1. Backward follows the
    same order with the chunks reversed. Rank r warms up with 2 (p - r - 1) + (v - 1) p
    forwards; then each unit is a forward and a backward whose four transfers are posted
    together after it (Megatron's send_forward_backward_recv_forward_backward).

    num_micro_batches must be a multiple of pp_size, the constraint of the paper and of
    Megatron-LM: with a short last group this transfer pairing deadlocks (the simulator
    finds it, e.g. p=4, v=2, m=6), and Megatron-Core's relaxation needs extra cases.
    """
    if num_micro_batches % pp_size:
        raise ConfigError(
            f"the interleaved schedule needs the number of micro-batches per step ({num_micro_batches} = global "
            f"batch / (micro batch x data-parallel size)) to be a multiple of --pipeline-model-parallel-size "
            f"({pp_size})")
    groups = [range(start, start + pp_size) for start in range(0, num_micro_batches, pp_size)]
    forward_order = [(mb, chunk) for group in groups for chunk in range(vp_size) for mb in group]
    backward_order = [(mb, vp_size - 1 - chunk) for mb, chunk in forward_order]
    total = len(forward_order)
    order = []
    for rank in range(pp_size):
        if forward_only:
            order.append([[Action(FORWARD, mb, chunk)] for mb, chunk in forward_order])
            continue
        warmup = min(2 * (pp_size - rank - 1) + (vp_size - 1) * pp_size, total)
        units = [[Action(FORWARD, mb, chunk)] for mb, chunk in forward_order[:warmup]]
        for (fmb, fchunk), (bmb, bchunk) in zip(forward_order[warmup:], backward_order):
            units.append([Action(FORWARD, fmb, fchunk), Action(BACKWARD, bmb, bchunk)])
        units += [[Action(BACKWARD, mb, chunk)] for mb, chunk in backward_order[total - warmup:]]
        order.append(units)
    return order


# -- transfers -----------------------------------------------------------------------------

def _with_communication(units: list[list[Action]], rank: int, pp_size: int, vp_size: int,
                        overlap_p2p: bool) -> Iterator[Action]:
    """Each unit's receives go right before it and its sends right after it. With overlap
    each compute is a unit of its own, and a receive goes one earlier when the compute
    before its consumer is of the other kind (a backward between two forwards)."""
    if overlap_p2p:
        units = [[action] for unit in units for action in unit]
    receives, sends = zip(*(_unit_transfers(unit, rank, pp_size, vp_size) for unit in units))
    posted_before = [[] for _ in units]
    for index, unit_receives in enumerate(receives):
        earlier = overlap_p2p and index > 0 and units[index - 1][0].kind != units[index][0].kind
        posted_before[index - 1 if earlier else index] += unit_receives
    for index, unit in enumerate(units):
        yield from posted_before[index]
        yield from unit
        yield from sends[index]


def _unit_transfers(unit: list[Action], rank: int, pp_size: int, vp_size: int) -> tuple[list[Action], list[Action]]:
    """(receives, sends) of a unit's computes; the first and last virtual stages neither
    receive nor send across the pipeline's ends."""
    last_stage = pp_size * vp_size - 1
    previous, following = (rank - 1) % pp_size, (rank + 1) % pp_size
    receives, sends = [], []
    for action in unit:
        stage, mb, chunk = action.chunk * pp_size + rank, action.micro_batch, action.chunk
        if action.kind == FORWARD:
            if stage > 0:
                receives.append(Action(RECV_ACTIVATION, mb, chunk, previous))
            if stage < last_stage:
                sends.append(Action(SEND_ACTIVATION, mb, chunk, following))
        else:
            if stage < last_stage:
                receives.append(Action(RECV_GRAD, mb, chunk, following))
            if stage > 0:
                sends.append(Action(SEND_GRAD, mb, chunk, previous))
    return receives, sends

"""Execute a pipeline schedule without a model: prove it safe and measure its bubble.

Each rank walks its steps (tessera.parallel.pipeline_actions.Schedule.steps) and waits
where the runner (tessera.parallel.pipeline) waits: on each batch of transfers right after
posting it, or with overlapped communication (`Schedule.overlap_p2p`) on a receive right
before the compute that consumes it and on everything at the end of the step. Posting
never blocks. A compute step takes a fixed time.

Transfers are modelled as strictly as NCCL runs them. A batch is posted as one group per
process group (activations and gradients have their own, so the two never overtake each
other's matching), and a group is one kernel on that group's stream: it starts only when
the rank's previous group on the same process group has completed, and completes only
when the groups holding all its partners have started (rendezvous: nothing is buffered).
A wait on a receive waits for its whole group. Transfers travel on FIFO channels, one per
(sender, receiver, activations or gradients), and the n-th receive on a channel must
expect the tensor of the n-th send.

A schedule that leaves a rank waiting forever raises `ScheduleError`; so does a receive
that would get the wrong micro-batch's tensor. With forward and backward times of
1 and 2 per stage (1/v and 2/v per chunk) the idle fraction of a rank is the pipeline
bubble the schedule would have with free communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Iterator

from tessera.parallel.pipeline_actions import (
    FORWARD, RECV_ACTIVATION, RECV_GRAD, SEND_ACTIVATION, SEND_GRAD, Action, Schedule,
)


class ScheduleError(RuntimeError):
    """A schedule whose transfers do not match, or that deadlocks."""


@dataclass(frozen=True)
class Simulation:
    makespan: Fraction
    busy: tuple[Fraction, ...]             # compute time per rank
    peak_live_activations: tuple[int, ...]  # per rank, in chunk activations (forwards not yet backwarded)

    def bubble(self, pp_rank: int) -> float:
        """Idle fraction of a rank: 1 - compute time / step time."""
        return float(1 - self.busy[pp_rank] / self.makespan)


@dataclass(frozen=True)
class _Wait:
    """A rank blocks until the groups carrying these transfers have completed."""
    transfers: tuple[Action, ...]

    def __str__(self) -> str:
        return "wait for " + " ".join(map(str, self.transfers))


@dataclass(eq=False)
class _Group:
    """The transfers of one batch on one process group: one kernel on its stream."""
    transfers: list[tuple[tuple, str, int]]   # (channel, side, index in the channel)
    posted: Fraction
    previous: _Group | None                   # the rank's group before it on the same process group
    started: Fraction | None = None
    completed: Fraction | None = None


def _timeline(schedule: Schedule, pp_rank: int) -> Iterator[Action | list[Action] | _Wait]:
    """A rank's steps with the runner's waits placed among them."""
    posted: list[Action] = []
    receiving: dict[tuple, Action] = {}   # overlap: receives not yet consumed
    for step in schedule.steps(pp_rank):
        if isinstance(step, Action):
            consumed = receiving.pop((RECV_ACTIVATION if step.kind == FORWARD else RECV_GRAD,
                                      step.micro_batch, step.chunk), None)
            if consumed is not None:
                yield _Wait((consumed,))
            yield step
            continue
        yield step
        if schedule.overlap_p2p:
            posted += step
            receiving.update(((a.kind, a.micro_batch, a.chunk), a) for a in step if a.kind.startswith("recv"))
        else:
            yield _Wait(tuple(step))
    if posted:   # the end of the step waits for everything still in flight
        yield _Wait(tuple(posted))


def _channel_and_message(action: Action, pp_rank: int, pp_size: int) -> tuple[tuple, tuple, str]:
    """(channel, tensor identity, 'send' or 'recv') of a transfer; tensors are named by the
    micro-batch and the virtual stage whose output (activation) or input (gradient) they are."""
    stage = action.chunk * pp_size + pp_rank
    family = "activation" if action.kind in (SEND_ACTIVATION, RECV_ACTIVATION) else "gradient"
    if action.kind in (SEND_ACTIVATION, SEND_GRAD):
        return (pp_rank, action.peer, family), (family, action.micro_batch, stage), "send"
    source_stage = stage - 1 if action.kind == RECV_ACTIVATION else stage + 1
    return (action.peer, pp_rank, family), (family, action.micro_batch, source_stage), "recv"


def simulate(schedule: Schedule, forward_time: Fraction | None = None,
             backward_time: Fraction | None = None) -> Simulation:
    pp_size = schedule.pp_size
    forward_time = forward_time if forward_time is not None else Fraction(1, schedule.vp_size)
    backward_time = backward_time if backward_time is not None else 2 * forward_time
    timelines = [list(_timeline(schedule, rank)) for rank in range(pp_size)]
    position = [0] * pp_size
    clock = [Fraction(0)] * pp_size
    busy = [Fraction(0)] * pp_size
    live, peak = [0] * pp_size, [0] * pp_size
    channels: dict[tuple, dict[str, list]] = {}   # channel -> side -> [(message, group)]
    groups: list[_Group] = []                      # posted, not yet completed
    carrying: dict[tuple[int, Action], _Group] = {}
    latest: dict[tuple[int, str], _Group] = {}     # (rank, process group) -> its last group
    while True:
        progressed = False
        for rank in range(pp_size):
            while position[rank] < len(timelines[rank]):
                step = timelines[rank][position[rank]]
                if isinstance(step, _Wait):
                    done = [carrying[rank, transfer].completed for transfer in step.transfers]
                    if None in done:
                        break
                    clock[rank] = max([clock[rank], *done])
                elif isinstance(step, list):
                    groups += _post(step, rank, pp_size, clock[rank], channels, carrying, latest)
                else:
                    duration = forward_time if step.kind == FORWARD else backward_time
                    clock[rank] += duration
                    busy[rank] += duration
                    live[rank] += 1 if step.kind == FORWARD else -1
                    peak[rank] = max(peak[rank], live[rank])
                position[rank] += 1
                progressed = True
        progressed |= _run_groups(groups, channels)
        if all(position[r] == len(timelines[r]) for r in range(pp_size)):
            break
        if not progressed:
            waiting = {r: str(timelines[r][position[r]]) for r in range(pp_size) if position[r] < len(timelines[r])}
            raise ScheduleError(f"{schedule.name} (p={pp_size}, v={schedule.vp_size}, "
                                f"m={schedule.num_micro_batches}{', overlapped' if schedule.overlap_p2p else ''}) "
                                f"deadlocks; ranks wait at {waiting}")
    for (source, target, family), sides in channels.items():
        if len(sides["send"]) != len(sides["recv"]):
            raise ScheduleError(f"{schedule.name}: {len(sides['send'])} {family} sends from rank {source} to "
                                f"rank {target} but {len(sides['recv'])} receives")
    return Simulation(max(clock), tuple(busy), tuple(peak))


def _post(batch: list[Action], rank: int, pp_size: int, now: Fraction, channels: dict, carrying: dict,
          latest: dict) -> list[_Group]:
    """Post a batch: one group per process group, each queued behind the rank's last one."""
    groups: dict[str, _Group] = {}
    for action in batch:
        channel, message, side = _channel_and_message(action, rank, pp_size)
        family = channel[2]
        if family not in groups:
            groups[family] = latest[rank, family] = _Group([], now, latest.get((rank, family)))
        queue = channels.setdefault(channel, {"send": [], "recv": []})[side]
        queue.append((message, groups[family]))
        groups[family].transfers.append((channel, side, len(queue) - 1))
        carrying[rank, action] = groups[family]
    return list(groups.values())


def _run_groups(groups: list[_Group], channels: dict) -> bool:
    """Start and complete every group that can, and drop the completed ones from `groups`;
    True if any did."""
    progressed, changed = False, True
    while changed:
        changed = False
        for group in groups:
            previous = group.previous
            if group.started is None and (previous is None or previous.completed is not None):
                group.started = group.posted if previous is None else max(group.posted, previous.completed)
                changed = True
            if group.started is not None and group.completed is None:
                partners = [_partner(channels, *transfer) for transfer in group.transfers]
                if all(partner is not None and partner.started is not None for partner in partners):
                    group.completed = max([group.started, *(partner.started for partner in partners)])
                    changed = True
        progressed |= changed
    groups[:] = [group for group in groups if group.completed is None]
    return progressed


def _partner(channels: dict, channel: tuple, side: str, index: int) -> _Group | None:
    """The group holding the other end of a transfer, once it is posted (checked to carry the same tensor)."""
    other = channels[channel]["recv" if side == "send" else "send"]
    if len(other) <= index:
        return None
    mine = channels[channel][side][index][0]
    if other[index][0] != mine:
        raise ScheduleError(f"transfer {side} #{index} on channel {channel} carries "
                            f"{mine} but its partner carries {other[index][0]}")
    return other[index][1]

"""Execute a pipeline schedule without a model: prove it safe and measure its bubble.

Each rank walks its steps (tessera.parallel.pipeline_schedules.Schedule.steps). A compute
step takes a fixed time; a batch of transfers completes only when every one of its
sends and receives has been posted by the rank at the other end (rendezvous, the
strictest model of batched isend/irecv). Transfers travel on FIFO channels, one per
(sender, receiver, activations or gradients) -- the runner uses separate process groups
for activations and gradients, so the two never overtake each other's matching -- and
the n-th receive on a channel must expect the tensor of the n-th send.

A schedule that leaves a rank waiting forever raises `ScheduleError`; so does a receive
that would get the wrong micro-batch's tensor. With forward and backward times of
1 and 2 per stage (1/v and 2/v per chunk) the idle fraction of a rank is the pipeline
bubble the schedule would have with free communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from tessera.parallel.pipeline_schedules import (
    BACKWARD, FORWARD, RECV_ACTIVATION, RECV_GRAD, SEND_ACTIVATION, SEND_GRAD, Action, Schedule,
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
    steps = [list(schedule.steps(rank)) for rank in range(pp_size)]
    position = [0] * pp_size
    clock = [Fraction(0)] * pp_size
    busy = [Fraction(0)] * pp_size
    live, peak = [0] * pp_size, [0] * pp_size
    channels: dict[tuple, dict[str, list]] = {}
    posted: list[list | None] = [None] * pp_size   # per rank: (channel, side, index) of its open batch
    while True:
        progressed = False
        for rank in range(pp_size):
            while position[rank] < len(steps[rank]):
                step = steps[rank][position[rank]]
                if isinstance(step, Action):
                    duration = forward_time if step.kind == FORWARD else backward_time
                    clock[rank] += duration
                    busy[rank] += duration
                    live[rank] += 1 if step.kind == FORWARD else -1
                    peak[rank] = max(peak[rank], live[rank])
                elif not _complete_batch(step, rank, pp_size, channels, posted, clock):
                    break
                position[rank] += 1
                progressed = True
        if all(position[r] == len(steps[r]) for r in range(pp_size)):
            break
        if not progressed:
            waiting = {r: str(steps[r][position[r]]) for r in range(pp_size) if position[r] < len(steps[r])}
            raise ScheduleError(f"{schedule.name} (p={pp_size}, v={schedule.vp_size}, "
                                f"m={schedule.num_micro_batches}) deadlocks; ranks wait at {waiting}")
    for (source, target, family), sides in channels.items():
        if len(sides["send"]) != len(sides["recv"]):
            raise ScheduleError(f"{schedule.name}: {len(sides['send'])} {family} sends from rank {source} to "
                                f"rank {target} but {len(sides['recv'])} receives")
    return Simulation(max(clock), tuple(busy), tuple(peak))


def _complete_batch(batch: list[Action], rank: int, pp_size: int, channels: dict, posted: list,
                    clock: list) -> bool:
    """Post the batch (once); True, with the rank's clock advanced, when every transfer in it
    has met its partner."""
    if posted[rank] is None:
        posted[rank] = []
        for action in batch:
            channel, message, side = _channel_and_message(action, rank, pp_size)
            queue = channels.setdefault(channel, {"send": [], "recv": []})[side]
            queue.append((message, clock[rank]))
            posted[rank].append((channel, side, len(queue) - 1))
    finish = clock[rank]
    for channel, side, index in posted[rank]:
        other = channels[channel]["recv" if side == "send" else "send"]
        if len(other) <= index:
            return False
        mine = channels[channel][side][index][0]
        if other[index][0] != mine:
            raise ScheduleError(f"rank {rank}: transfer {side} #{index} on channel {channel} carries "
                                f"{mine} but its partner carries {other[index][0]}")
        finish = max(finish, other[index][1])
    clock[rank] = finish
    posted[rank] = None
    return True

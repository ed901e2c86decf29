"""Pipeline parallelism at run time: the runner that executes a schedule
(tessera.parallel.pipeline_schedules) with batched point-to-point transfers.

A stage is a view of the one model: GPTModel built with the blocks of this rank's chunks
(keeping their global indices, so names, initialisation and checkpoints do not depend
on the layout), the embedding on the first stage and the final norm, output layer and
loss on the last, with the multi-token-prediction depths (they need nothing from the other
stages but the tokens every stage reads). `PipelineRunner` knows nothing of tokens: the
trainer gives it a `forward_step(chunk, micro_batch, input)` that returns the chunk's
output activation, or on the last virtual stage the scalar loss to backpropagate.

Transfers between neighbours use `batch_isend_irecv` with shapes known ahead of time
(the trainer passes [micro batch, sequence / TP under SP, hidden]), so no shape ever
travels. Activations and gradients go through separate process groups: with two ranks
and virtual stages both flow between the same pair of ranks, and separate
communicators keep their send/receive matching independent (what the schedule
simulator assumes when it proves a schedule cannot deadlock).

Without overlap every batch of transfers is waited on before the next compute. With
--overlap-p2p-communication (`Schedule.overlap_p2p`, whose order posts receives earlier)
transfers stay in flight: a compute waits only for the receive it consumes, and sends are
waited on at the end of the step (their tensors are never written again before then).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tessera.parallel.pipeline_actions import (
    FORWARD, RECV_ACTIVATION, RECV_GRAD, SEND_ACTIVATION, SEND_GRAD, Action, Schedule,
)


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's pipeline communicators (each created on every rank, in the same order)."""

    ranks: tuple[int, ...]     # global ranks of this rank's pipeline, by stage
    activations: object        # the mesh's pp group carries activations ...
    gradients: object          # ... and a twin carries gradients
    embedding: object          # first + last stage: word-embedding gradients (None when the last stage has none)
    embedding_dp: object       # first + last stage x all data-parallel ranks (distributed optimizer)

    @classmethod
    def build(cls, mesh, *, shared_embedding: bool) -> "PipelineGroups":
        """`shared_embedding`: the last stage holds a copy of the word embedding (a tied output
        layer, or MTP's input: ModelConfig.last_stage_embedding)."""
        tp, cp, dp, pp = mesh.tp_size, mesh.cp_size, mesh.dp_size, mesh.pp_size
        mine = {}
        for name, members in _pipeline_group_ranks(tp, cp, dp, pp, shared_embedding):
            group = dist.new_group(members)   # collective: every rank creates every group
            if mesh.rank in members:
                mine[name] = (group, members)
        # NCCL: the first operation on a communicator should involve all its ranks.
        for group, _ in mine.values():
            dist.all_reduce(torch.zeros(1, device=_device_of(group)), group=group)
        get = lambda name: mine[name][0] if name in mine else None  # noqa: E731
        return cls(tuple(mine["gradients"][1]), mesh.group("pp"), get("gradients"), get("embedding"),
                   get("embedding_dp"))


def _pipeline_group_ranks(tp: int, cp: int, dp: int, pp: int, tied: bool):
    rank = lambda t, c, d, p: t + tp * (c + cp * (d + dp * p))  # noqa: E731  Megatron's order
    for t in range(tp):
        for c in range(cp):
            for d in range(dp):
                members = [rank(t, c, d, p) for p in range(pp)]
                yield "gradients", members
                if tied:
                    yield "embedding", [members[0], members[-1]]
        if tied:  # the distributed optimizer shards over dp x cp
            yield "embedding_dp", sorted(rank(t, c, d, p) for p in (0, pp - 1) for d in range(dp) for c in range(cp))


def _device_of(group) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


class PipelineRunner:
    """Executes one rank's actions of a schedule: forwards, backwards and transfers."""

    def __init__(self, schedule: Schedule, pp_rank: int, groups: PipelineGroups, *, activation_shape: tuple,
                 dtype: torch.dtype, device: torch.device):
        self.schedule, self.pp_rank, self.groups = schedule, pp_rank, groups
        self.shape, self.dtype, self.device = activation_shape, dtype, device
        self.last_stage = schedule.pp_size * schedule.vp_size - 1
        self._timings: list = []   # start, (compute start, compute end)..., end of the last run

    def stage(self, chunk: int) -> int:
        return chunk * self.schedule.pp_size + self.pp_rank

    def run(self, forward_step: Callable[[int, int, torch.Tensor | None], torch.Tensor],
            before_backward: Callable[[int, int], None] = lambda micro_batch, chunk: None) -> None:
        """Run the schedule. `before_backward(micro_batch, chunk)` is called before each backward
        (the trainer marks each chunk's last one for the data-parallel overlap)."""
        inputs, outputs, received, outgoing = {}, {}, {}, {}
        in_flight = []   # the works of each posted group (emptied once waited on)
        self._timings = [_now(self.device)]
        for step in self.schedule.steps(self.pp_rank):
            if isinstance(step, list):
                in_flight += self._post(step, outgoing, received)
                if not self.schedule.overlap_p2p:
                    _wait_all(in_flight)
                else:   # finished groups' tensors need not live to the end of the step
                    in_flight = [works for works in in_flight if not all(work.is_completed() for work in works)]
                continue
            key = (step.micro_batch, step.chunk)
            start = _now(self.device)
            if step.kind == FORWARD:
                hidden = _arrived(received, (RECV_ACTIVATION,) + key)
                output = forward_step(step.chunk, step.micro_batch, hidden)
                if self.stage(step.chunk) < self.last_stage:
                    outgoing[(SEND_ACTIVATION,) + key] = output.detach()
                if not self.schedule.forward_only:
                    inputs[key], outputs[key] = hidden, output
            else:
                before_backward(*key)
                self._backward(step, inputs.pop(key), outputs.pop(key), received, outgoing)
            self._timings.append((start, _now(self.device)))
        _wait_all(in_flight)
        self._timings.append(_now(self.device))

    def _backward(self, step: Action, hidden, output, received: dict, outgoing: dict) -> None:
        if self.stage(step.chunk) == self.last_stage:
            torch.autograd.backward(output)   # the (scaled) loss
        else:
            grad = _arrived(received, (RECV_GRAD, step.micro_batch, step.chunk))
            torch.autograd.backward(output, grad_tensors=grad.to(output.dtype))
        if self.stage(step.chunk) > 0:
            outgoing[(SEND_GRAD, step.micro_batch, step.chunk)] = hidden.grad

    def _post(self, batch: list[Action], outgoing: dict, received: dict) -> list:
        """Post a batch of transfers at once, one batch_isend_irecv per process group, and
        return each group's works. Each receive lands in `received` with its group's works:
        NCCL completes a group as one, so a receive is waited on with its group."""
        ops = {"activation": [], "gradient": []}
        receives = {"activation": [], "gradient": []}
        for action in batch:
            family = "activation" if action.kind in (SEND_ACTIVATION, RECV_ACTIVATION) else "gradient"
            group = self.groups.activations if family == "activation" else self.groups.gradients
            peer = self.groups.ranks[action.peer]
            key = (action.kind, action.micro_batch, action.chunk)
            if action.kind.startswith("send"):
                tensor = outgoing.pop(key).to(self.dtype).contiguous()
                ops[family].append(dist.P2POp(dist.isend, tensor, peer, group))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device,
                                     requires_grad=action.kind == RECV_ACTIVATION and not self.schedule.forward_only)
                receives[family].append((key, tensor))
                ops[family].append(dist.P2POp(dist.irecv, tensor, peer, group))
        posted = []
        for family, family_ops in ops.items():
            if family_ops:
                works = dist.batch_isend_irecv(family_ops)
                received.update((key, (tensor, works)) for key, tensor in receives[family])
                posted.append(works)
        return posted

    def measured_bubble(self) -> float:
        """Idle fraction of the last run on this rank: 1 - compute time / schedule time
        (waits for the device: call it when logging, not every step)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        first, *computes, last = self._timings
        busy = sum(_seconds(start, end) for start, end in computes)
        return 1.0 - busy / max(_seconds(first, last), 1e-12)


def _wait(works: list) -> None:
    """Wait for a group of transfers (on a GPU: make the compute stream wait for them), once:
    the list is emptied, as a gloo receive waited on twice would wait for a second message."""
    for work in works:
        work.wait()
    works.clear()


def _wait_all(groups: list[list]) -> None:
    for works in groups:
        _wait(works)
    groups.clear()


def _arrived(received: dict, key: tuple) -> torch.Tensor | None:
    """The tensor received for `key` (None if none was), once its group has completed
    (it has already, unless transfers overlap compute)."""
    if key not in received:
        return None
    tensor, works = received.pop(key)
    _wait(works)
    return tensor


def _now(device: torch.device):
    """A point in time: a recorded CUDA event (the GPU's clock) or the host clock."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(start, end) -> float:
    return start.elapsed_time(end) / 1000 if hasattr(start, "elapsed_time") else end - start


@torch.no_grad()
def sum_tied_grads(slices: list[tuple[torch.Tensor, int]], numel: int, group, device: torch.device) -> None:
    """Sum the gradient of the word embedding, used by the first stage (input) and the last
    (tied output layer, MTP input), over `group`, so that both copies take the same step and stay equal.

    `slices` are the (gradient, flat offset) pieces of the weight this rank holds, already
    reduced over data-parallel ranks: the whole gradient with the embedding group, or the
    distributed optimizer's owned slices with the embedding x data-parallel group (each
    region is owned by one rank per stage, so the sum adds every contribution once). A rank
    that owns no slice still takes part.
    """
    if group is None:
        return
    full = torch.zeros(numel, dtype=torch.float32, device=device)
    for grad, offset in slices:
        full[offset:offset + grad.numel()] += grad.flatten()
    dist.all_reduce(full, group=group)
    for grad, offset in slices:
        grad.copy_(full[offset:offset + grad.numel()].view_as(grad))

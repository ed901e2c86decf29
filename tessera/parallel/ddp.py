"""Data parallelism: gradients in contiguous bucketed buffers, reduced during backward.

Every gradient lives in one flat fp32 buffer ("main grads"), laid out in the reverse
order of registration, which is roughly the order backward produces them. The buffer
is cut into buckets of about --ddp-bucket-size elements. With --overlap-grad-reduce, a
bucket's collective starts as soon as the last of its gradients has been accumulated
in the last micro-batch of a step, so communication hides behind the rest of backward;
earlier micro-batches only accumulate.

The collective is a sum: the trainer divides each rank's loss by the number of tokens
in the *global* batch, so summing over data-parallel ranks gives the mean gradient
exactly once. With the distributed optimizer the sum is a reduce-scatter: each rank
receives the sum of its own 1/DP of every bucket (buckets are padded to split evenly).
Megatron's partial distributed optimizer (--num-distributed-optimizer-instances N) reduce-
scatters over one replica's ranks and then all-reduces each rank's slice over the N
replicas (megatron/core/distributed/param_and_grad_buffer.py, start_grad_sync); that
all-reduce runs when the step's reduction finishes, not during backward.

Written here rather than using torch DDP because the distributed optimizer needs to own
the buffer layout (its shards are slices of these buckets), and because Megatron's
"sum once over dp x cp, reduce in bf16 or fp32" choices must be explicit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.collectives import reduce_scatter_flat


@dataclass
class Bucket:
    start: int                       # [start, end) in the flat buffer; end - start divides by DP
    end: int
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    work: object = None              # the in-flight collective
    staging: torch.Tensor | None = None   # low-precision copy on the wire, if any


class GradBuffer:
    """Flat main-grad buffer of `params`, bucketed, summed over `group` (sum or reduce-scatter).

    `stored=False` keeps no buffer: with nothing to reduce and one micro-batch per step the
    gradients autograd makes are already the main grads (the layout still serves the
    distributed optimizer's flat weights). With bf16 weights that saves an fp32 copy of every
    gradient, and the memory of one: the values are the same, since an fp32 buffer would
    only hold the bf16 gradients upcast.
    """

    def __init__(self, params: list[nn.Parameter], group, *, bucket_size: int, overlap: bool,
                 reduce_scatter: bool, reduce_dtype: torch.dtype = torch.float32, stored: bool = True,
                 replica_group=None):
        """`replica_group` (with `reduce_scatter`, HSDP): the copies of this rank's slices, which
        are summed over it after the reduce-scatter over `group`."""
        if not stored and group is not None:
            raise ValueError("gradients reduced over a group need a stored buffer")
        if replica_group is not None and not (reduce_scatter and group is not None):
            raise ValueError("a replica group sums reduce-scattered slices: it needs reduce_scatter and a group")
        self.group, self.overlap, self.reduce_scatter, self.reduce_dtype = group, overlap, reduce_scatter, reduce_dtype
        self.replica_group = replica_group
        self.stored = stored
        self.dp_size = dist.get_world_size(group) if group is not None else 1
        self.dp_rank = dist.get_rank(group) if group is not None else 0
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        self.buckets: list[Bucket] = []
        offset, bucket_start, members = 0, 0, []
        for param in reversed([p for p in params if p.requires_grad]):
            self.ranges[param] = (offset, offset + param.numel())
            offset += param.numel()
            members.append(param)
            if offset - bucket_start >= bucket_size:
                offset = self._close_bucket(bucket_start, offset, members)
                bucket_start, members = offset, []
        if members:
            offset = self._close_bucket(bucket_start, offset, members)
        self.size = offset
        self.data = torch.zeros(offset, dtype=torch.float32, device=params[0].device) if stored else None
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._last_micro_batch = True
        self._unwritten: set[nn.Parameter] = set()   # low-precision params without a gradient yet this step
        for param in self.ranges if stored else ():
            if param.dtype == torch.float32:
                param.grad = self.view(param)  # autograd accumulates into the buffer in place
            param.register_post_accumulate_grad_hook(self._on_grad_accumulated)

    def _close_bucket(self, start: int, end: int, members: list[nn.Parameter]) -> int:
        padded = start + -(-(end - start) // self.dp_size) * self.dp_size
        self.buckets.append(Bucket(start, padded, list(members)))
        return padded

    def view(self, param: nn.Parameter) -> torch.Tensor:
        if not self.stored:
            if param.grad is None:   # not used this step
                param.grad = torch.zeros_like(param)
            return param.grad
        start, end = self.ranges[param]
        return self.data[start:end].view_as(param)

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """The slice of `bucket` this rank owns under reduce-scatter."""
        size = (bucket.end - bucket.start) // self.dp_size
        start = bucket.start + self.dp_rank * size
        return start, start + size

    # -- per step --------------------------------------------------------------------

    def zero(self) -> None:
        if not self.stored:
            for param in self.ranges:
                param.grad = None
            return
        if all(param.dtype != torch.float32 for param in self.ranges):
            # Each main grad is written by its first gradient of the step (copied, not added):
            # no pass to zero the buffer; finish() zeroes those that never got one.
            self._unwritten = set(self.ranges)
        else:   # fp32 parameters accumulate into their buffer views in place
            self.data.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()

    def set_last_micro_batch(self, last: bool) -> None:
        """Collectives start only in the last micro-batch of a step; earlier ones accumulate."""
        self._last_micro_batch = last

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        if param.dtype != torch.float32:
            # Low-precision parameters (distributed optimizer with bf16 weights): add the
            # fresh gradient to the fp32 main grad and free it.
            if param in self._unwritten:
                self.view(param).copy_(param.grad)
                self._unwritten.discard(param)
            else:
                self.view(param).add_(param.grad)
            param.grad = None
        if not (self.overlap and self._last_micro_batch):
            return
        bucket = self._bucket_of[param]
        bucket.ready.add(param)
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.group is None or bucket.work is not None:
            return
        data = self.data[bucket.start:bucket.end]
        if self.reduce_dtype != torch.float32:
            bucket.staging = data.to(self.reduce_dtype)
            data = bucket.staging
        if self.reduce_scatter:
            start, end = self.shard_range(bucket)
            output = torch.empty(end - start, dtype=data.dtype, device=data.device)
            work = reduce_scatter_flat(output, data, group=self.group, async_op=True)
            bucket.work = (work, output)
        else:
            bucket.work = (dist.all_reduce(data, group=self.group, async_op=True), None)

    def finish(self) -> None:
        """Start any collective not yet started, wait for all, and land results in the buffer."""
        for param in self._unwritten:
            self.view(param).zero_()
        self._unwritten = set()
        if self.group is None:
            return
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            work, output = bucket.work
            work.wait()
            if output is not None:
                if self.replica_group is not None:
                    dist.all_reduce(output, group=self.replica_group)
                start, end = self.shard_range(bucket)
                self.data[start:end].copy_(output)
            elif bucket.staging is not None:
                self.data[bucket.start:bucket.end].copy_(bucket.staging)
            bucket.work, bucket.staging = None, None


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default: max(40M, 1M x DP) elements."""
    return max(40_000_000, 1_000_000 * dp_size)

"""How parameters are split over the ranks of a tensor-parallel (TP) group.

`ShardSpec` says how one rank's shard is cut from the full parameter, and puts the full
parameter back together from all shards: layout-invariant initialisation, checkpoints
and Hugging Face conversion all work on the full tensor through it. Every parameter of
a tessera model carries one (`param.shard_spec`, set by `annotate`).

A MoE layer's expert weights are stacked along dim 0, one row per expert, and cut twice:
expert parallelism gives each rank a contiguous block of experts (`expert_rank` of
`expert_size`), and expert tensor parallelism cuts each expert like a TP layer (then the
spec's rank and size are those of the expert-TP group). Such parameters are marked
`is_expert`: their gradients are reduced over the expert-data-parallel group instead.

Some parameters, or pieces of them, are replicated over TP ranks rather than split, and
their gradients need care:
- replicated KV groups (fewer groups than ranks): each replica sees only its own query
  heads, so their gradients are summed over the replicas in backward;
- parameters used on sequence shards under sequence parallelism (norms, row-parallel
  biases, position embeddings): `allreduce_sequence_parallel_grads` after backward;
- global norms count each replicated element once: `ShardSpec.counted_mask`, `grad_norm_squared`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn


def rank_and_size(group) -> tuple[int, int]:
    """(rank, size) of this process in a TP group; (0, 1) for None (TP=1)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class Piece:
    """One contiguous block of a shard along the split dimension."""

    full_start: int   # where the block starts in the full parameter
    local_start: int  # where it starts in the shard
    length: int
    index: int        # which of its segment's `splits` pieces it is
    splits: int
    replicas: int     # how many TP ranks hold this same block
    counted: bool     # whether this rank is the first of them (counts it in global norms)


@dataclass(frozen=True)
class ShardSpec:
    """How one TP rank's shard is cut from a full parameter.

    `segments` lists the sizes along `dim` of the blocks fused in one weight (q, k and v
    of a fused QKV projection); each block is cut into `splits` equal pieces (default:
    one per rank), and a rank's shard is its piece of every block, concatenated. A block
    cut into fewer pieces than ranks is replicated: rank r holds piece r * splits // size
    (with fewer KV groups than TP ranks, each rank holds the group its query heads use).
    `dim=None` means the whole parameter is replicated on all `size` ranks.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    segments: tuple[int, ...] | None = None
    rank: int = 0
    size: int = 1
    splits: tuple[int, ...] | None = None
    expert_rank: int = 0   # expert parallelism: this rank's block of dim 0 ...
    expert_size: int = 1   # ... out of this many

    def __post_init__(self) -> None:
        if self.expert_size > 1 and (self.dim == 0 or self.full_shape[0] % self.expert_size):
            raise ValueError(f"{self.full_shape[0]} experts do not split over {self.expert_size} ranks along dim 0")

    @property
    def replicated(self) -> bool:
        """True when every TP rank holds the whole of this rank's experts (or the whole parameter)."""
        return self.dim is None or self.size == 1

    @property
    def expert_offset(self) -> int:
        """Where this rank's block of experts starts along dim 0 of the full parameter."""
        return self.expert_rank * (self.full_shape[0] // self.expert_size)

    @property
    def tp_full_shape(self) -> tuple[int, ...]:
        """The shape that the TP shards put together: the full shape, with this rank's experts only."""
        return (self.full_shape[0] // self.expert_size, *self.full_shape[1:])

    def pieces(self) -> list[Piece]:
        segments = self.segments or (self.full_shape[self.dim],)
        splits = self.splits or (self.size,) * len(segments)
        pieces, full_start, local_start = [], 0, 0
        for segment, split in zip(segments, splits):
            if self.size % split or segment % split:
                raise ValueError(f"cannot cut a block of {segment} into {split} pieces for {self.size} ranks")
            length, replicas = segment // split, self.size // split
            pieces.append(Piece(full_start + self.rank // replicas * length, local_start, length,
                                self.rank // replicas, split, replicas, self.rank % replicas == 0))
            full_start += segment
            local_start += length
        return pieces

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full parameter."""
        if self.expert_size > 1:
            full = full.narrow(0, self.expert_offset, self.tp_full_shape[0])
        if self.replicated:
            return full
        return torch.cat([full.narrow(self.dim, p.full_start, p.length) for p in self.pieces()], dim=self.dim)

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameter whole over TP from every TP rank's shard, in TP-rank order (for expert
        weights: this rank's experts; concatenate the expert-parallel ranks' along dim 0)."""
        if self.replicated:
            return shards[0]
        full = shards[0].new_empty(self.tp_full_shape)
        for rank, shard in enumerate(shards):
            for p in dataclasses.replace(self, rank=rank).pieces():
                full.narrow(self.dim, p.full_start, p.length).copy_(shard.narrow(self.dim, p.local_start, p.length))
        return full

    def counted_mask(self) -> torch.Tensor | None:
        """Which elements of this shard this rank counts in a norm summed over the TP group,
        so that every element of the full parameter is counted exactly once.

        None: all of them. Otherwise a bool tensor that broadcasts to the shard's shape
        (all False on ranks other than 0 for a replicated parameter).
        """
        if self.size == 1:
            return None
        if self.dim is None:
            return None if self.rank == 0 else torch.tensor(False)
        pieces = self.pieces()
        if all(p.counted and p.replicas == 1 for p in pieces):
            return None
        mask = torch.cat([torch.full((p.length,), p.counted) for p in pieces])
        return mask.view(-1, *[1] * (len(self.full_shape) - self.dim - 1))


def annotate(param: nn.Parameter, spec: ShardSpec, *, init_std: float | None = None,
             init_value: float = 0.0, sequence_parallel: bool = False, is_expert: bool = False) -> nn.Parameter:
    """Record how `param` is sharded and initialised (tessera.models.gpt.initialize_parameters).

    `init_std=None` fills with `init_value` (zeros for biases, ones for norm weights).
    `sequence_parallel=True` marks a TP-replicated parameter used on sequence shards: its
    gradient is partial on each rank (see allreduce_sequence_parallel_grads).
    `is_expert=True` marks a MoE expert weight (reduced over expert data parallelism).
    """
    param.shard_spec = spec
    param.init_std = init_std
    param.init_value = init_value
    param.sequence_parallel = sequence_parallel
    param.is_expert = is_expert
    return param


# -- gradients of replicated parameters ------------------------------------------------

class _SumReplicaGrads(torch.autograd.Function):
    """Identity in forward; in backward, sums the gradient of replicated pieces over the
    ranks that hold them, so every replica gets the full gradient and stays equal."""

    @staticmethod
    def forward(ctx, tensor, spec, group):
        ctx.spec, ctx.group = spec, group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        spec, dim = ctx.spec, ctx.spec.dim
        pieces = [p for p in spec.pieces() if p.replicas > 1]
        # One all-reduce over the whole TP group: each piece gets a slot per split, each
        # rank writes its slot, and the sum adds exactly the ranks holding the same piece.
        slots = []
        for p in pieces:
            local = grad.narrow(dim, p.local_start, p.length).movedim(dim, 0)
            slot = local.new_zeros((p.splits, *local.shape))
            slot[p.index] = local
            slots.append(slot)
        flat = torch.cat([s.flatten() for s in slots])
        dist.all_reduce(flat, group=ctx.group)
        grad = grad.clone()
        for p, slot, summed in zip(pieces, slots, flat.split([s.numel() for s in slots])):
            grad.narrow(dim, p.local_start, p.length).copy_(summed.view_as(slot)[p.index].movedim(0, dim))
        return grad, None, None


def sum_replica_grads(tensor: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """`tensor` (a parameter cut by `spec`), with its replicated pieces' gradients summed
    over their replicas. The spec is passed in rather than read from the parameter: FSDP2
    runs forward on all-gathered parameter objects that carry no attributes."""
    if spec.replicated or all(p.replicas == 1 for p in spec.pieces()):
        return tensor
    return _SumReplicaGrads.apply(tensor, spec, group)


@torch.no_grad()
def allreduce_sequence_parallel_grads(model: nn.Module, tp_group, main_grad=None) -> None:
    """Sum over the TP group the gradients of parameters marked `sequence_parallel`.

    Under sequence parallelism, norms, row-parallel biases and position embeddings see
    only this rank's tokens, so each rank's gradient is a partial sum. Call once per step,
    after backward and after the data-parallel gradient reduction, before the grad norm.
    `main_grad(param)` returns the tensor holding the gradient (default: `param.grad`).
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    grads = [main_grad(p) if main_grad else p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False)]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(summed.view_as(grad))


def grad_norm_squared(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's part of the squared L2 norm of the full gradients (fp32).

    All-reduce the result over the TP group to get the square of the global norm: each
    element of every full parameter is counted once, replicated ones on one rank only
    (see ShardSpec.counted_mask).
    """
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
    for param, grad in zip(params, grads):
        spec = getattr(param, "shard_spec", None)
        mask = spec.counted_mask() if spec is not None else None
        squares = grad.float().square()
        total += squares.sum() if mask is None else (squares * mask.to(squares.device)).sum()
    return total

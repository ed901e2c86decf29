"""Tensor and sequence parallelism (Megatron-style): layers that split their weights over
the ranks of a tensor-parallel (TP) group, and the autograd collectives between them.

    ColumnParallelLinear   W split by output rows: each rank computes some output features
    RowParallelLinear      W split by input columns: partial sums reduced over ranks
    VocabParallelEmbedding vocabulary rows split: each rank looks up the ids it holds
    vocab_parallel_cross_entropy   loss of vocab-split logits without gathering them

Every collective comes with its conjugate in backward (all-reduce <-> identity,
all-gather <-> reduce-scatter/split). With --sequence-parallel, the activations between
TP regions (norms, dropout, residuals) are split along the sequence: all-gather before a
column-parallel layer and reduce-scatter after a row-parallel one replace the all-reduce;
with `comm_overlap` (--tp-comm-overlap) each runs in chunks under its GEMM
(tessera.parallel.tp_overlap).

Each layer stores only its shard and records how it is cut from the full weight
(tessera.parallel.sharding.ShardSpec). With `tp_group=None` (TP=1) every layer is
exactly nn.Linear / nn.Embedding and no collective runs.

The linear layers have an `adapter` slot (None unless fine-tuning with LoRA,
tessera.posttrain.lora): a module called as `adapter(x, y)` on the layer's input (its own shard
of it) and output, which returns the output with the adapter's update added.

Activations are [batch, seq, hidden]; the sequence dimension is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.kernels.gemv import linear
from tessera.kernels.activation_linear import activate, activation_linear
from tessera.kernels.swiglu import on_triton
from tessera.parallel.collectives import all_gather_flat, reduce_scatter_flat
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size, sum_replica_grads
from tessera.parallel.tp_overlap import SEQUENCE_DIM, all_gather_matmul, eager, matmul_reduce_scatter


# -- the conjugate collectives ---------------------------------------------------------

def _identity(x, group):
    return x


def _all_reduce(x, group):
    # In place: every call site passes a fresh activation or gradient no one else holds.
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, group, dim):
    size = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()  # collectives concatenate along dim 0
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_flat(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _split_size(x, group, dim) -> tuple[int, int]:
    rank, size = rank_and_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {size} ranks")
    return rank, size


def _reduce_scatter(x, group, dim):
    _, size = _split_size(x, group, dim)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    reduce_scatter_flat(out, x, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x, group, dim):
    rank, size = _split_size(x, group, dim)
    return x.chunk(size, dim=dim)[rank].contiguous()


def _last(op):
    return lambda x, group: op(x, group, -1)


def _sequence(op):
    return lambda x, group: op(x, group, SEQUENCE_DIM)


def _first(op):
    return lambda x, group: op(x, group, 0)


class _Conjugate(torch.autograd.Function):
    """`forward_op` in forward, `backward_op` on the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


def _conjugate(forward_op, backward_op):
    def region(x: torch.Tensor, group) -> torch.Tensor:
        if group is None or dist.get_world_size(group) == 1:
            return x
        return _Conjugate.apply(x, group, forward_op, backward_op)
    return region


# Megatron's f and g: a replicated input enters a TP region / partial outputs leave it.
copy_to_tp_region = _conjugate(_identity, _all_reduce)
reduce_from_tp_region = _conjugate(_all_reduce, _identity)
# The last (feature) dimension split over ranks, or gathered back.
scatter_to_tp_region = _conjugate(_last(_split), _last(_all_gather))
gather_from_tp_region = _conjugate(_last(_all_gather), _last(_split))
# Sequence parallelism: the sequence dimension split over ranks.
scatter_to_sequence_region = _conjugate(_sequence(_split), _sequence(_all_gather))
gather_from_sequence_region = _conjugate(_sequence(_all_gather), _sequence(_reduce_scatter))
reduce_scatter_to_sequence_region = _conjugate(_sequence(_reduce_scatter), _sequence(_all_gather))
# Token-major tensors [tokens, ...] (MoE dispatch): every rank's rows concatenated, and the
# partial sums of those rows reduced back to their owners.
all_gather_tokens = _conjugate(_first(_all_gather), _first(_reduce_scatter))
reduce_scatter_tokens = _conjugate(_first(_reduce_scatter), _first(_all_gather))


# -- layers ----------------------------------------------------------------------------

def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp_group, *,
                           sequence_parallel: bool = False, overlapped_gather=None,
                           matmul=linear) -> torch.Tensor:
    """x W^T + b for a row-sharded W: the input enters the TP region (all-gathered along the
    sequence under sequence parallelism; chunk by chunk under the GEMM by `overlapped_gather`,
    `eager(all_gather_matmul)`, where given), each rank computes its output features."""
    if overlapped_gather is not None:
        return overlapped_gather(x, weight, bias, tp_group)
    x = gather_from_sequence_region(x, tp_group) if sequence_parallel else copy_to_tp_region(x, tp_group)
    return matmul(x, weight, bias)


def _overlap_switch(overlapped) -> property:
    """A layer's `comm_overlap`: on, `self._overlapped` is `overlapped` (all_gather_matmul or
    matmul_reduce_scatter) kept eager for compiled blocks; off, None."""
    def get(self) -> bool:
        return self._overlapped is not None

    def set(self, on: bool) -> None:
        self._overlapped = eager(overlapped) if on else None

    return property(get, set)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows over tensor-parallel ranks.

    The output stays split along its last dimension unless `gather_output`. With
    `sequence_parallel` the input is a sequence shard and is all-gathered first (overlapped with
    the GEMM with `comm_overlap`).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float,
                 segments: tuple[int, ...] | None = None, splits: tuple[int, ...] | None = None,
                 tp_group=None, gather_output: bool = False, sequence_parallel: bool = False,
                 comm_overlap: bool = False):
        super().__init__()
        if gather_output and segments:
            raise ValueError("gather_output would interleave the fused segments' pieces")
        if comm_overlap and not sequence_parallel:
            raise ValueError("comm_overlap needs sequence_parallel")
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.comm_overlap = comm_overlap
        rank, size = rank_and_size(tp_group)
        spec = ShardSpec((out_features, in_features), 0, segments, rank, size, splits)
        local_out = sum(p.length for p in spec.pieces())
        self.weight = annotate(nn.Parameter(torch.empty(local_out, in_features)), spec, init_std=init_std)
        self.weight_spec, self.bias_spec = spec, ShardSpec((out_features,), 0, segments, rank, size, splits)
        if bias:
            self.bias = annotate(nn.Parameter(torch.empty(local_out)), self.bias_spec)
        else:
            self.register_parameter("bias", None)
        self.fp8 = None   # an Fp8Linear when training in FP8 (tessera.training.fp8): the GEMM in place of `linear`
        self.adapter = None   # a LoRA adapter (tessera.posttrain.lora)

    comm_overlap = _overlap_switch(all_gather_matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = sum_replica_grads(self.weight, self.weight_spec, self.tp_group)
        bias = None if self.bias is None else sum_replica_grads(self.bias, self.bias_spec, self.tp_group)
        y = column_parallel_linear(x, weight, bias, self.tp_group, sequence_parallel=self.sequence_parallel,
                                   overlapped_gather=self._overlapped, matmul=self.fp8 or linear)
        if self.adapter is not None:
            y = self.adapter(x, y)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are reduced over ranks.

    The input is split along its last dimension (`input_is_parallel`, the output of a
    ColumnParallelLinear) or is split here. The sum is an all-reduce, or with
    `sequence_parallel` a reduce-scatter to sequence shards (overlapped with the GEMM with
    `comm_overlap`). The bias is added once, after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float, tp_group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, comm_overlap: bool = False):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel")
        if comm_overlap and not sequence_parallel:
            raise ValueError("comm_overlap needs sequence_parallel")
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        self.comm_overlap = comm_overlap
        rank, size = rank_and_size(tp_group)
        if in_features % size:
            raise ValueError(f"{in_features} input features do not split over {size} tensor-parallel ranks")
        spec = ShardSpec((out_features, in_features), 1, None, rank, size)
        self.weight = annotate(nn.Parameter(torch.empty(out_features, in_features // size)), spec, init_std=init_std)
        if bias:
            # Replicated; under sequence parallelism each rank adds it to its own tokens only.
            bias_spec = ShardSpec((out_features,), None, None, rank, size)
            self.bias = annotate(nn.Parameter(torch.empty(out_features)), bias_spec,
                                 sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self.fp8 = None   # as ColumnParallelLinear's
        self.adapter = None   # as ColumnParallelLinear's; it sees act(x), so the activation is not fused then

    comm_overlap = _overlap_switch(matmul_reduce_scatter)

    def forward(self, x: torch.Tensor, *, activation: str | None = None) -> torch.Tensor:
        """With an `activation` ("swiglu", "gelu", "gelu_tanh") x is fc1's output and act(x) enters
        the GEMM: fused with it when training on CUDA (tessera.kernels.activation_linear)."""
        if activation:
            if self._fuses_activation(x):
                return self._reduce(activation_linear(x, self.weight, activation))
            x = activate(x, activation)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        if self._overlapped is not None:
            y = self._overlapped(x, self.weight, self.tp_group)
            y = y if self.bias is None else y + self.bias
        else:
            y = self._reduce((self.fp8 or linear)(x, self.weight))
        return y if self.adapter is None else self.adapter(x, y)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The partial sums over ranks, then the bias."""
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def _fuses_activation(self, x: torch.Tensor) -> bool:
        """Fused where the kernels run and an autograd backward follows; FP8 and the overlapped
        reduce-scatter have GEMMs of their own, and an adapter needs act(x) itself."""
        return (on_triton(x) and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
                and self.input_is_parallel and self.fp8 is None and not self.comm_overlap and self.adapter is None)


def enable_comm_overlap(model: nn.Module) -> None:
    """--tp-comm-overlap: every sequence-parallel linear in `model` overlaps its collective with its GEMM."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.sequence_parallel:
            module.comm_overlap = True


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over tensor-parallel ranks.

    Each rank looks up the ids in its range and zeros the rest; the sum over ranks is the
    embedding (an all-reduce, or with `sequence_parallel` a reduce-scatter to sequence shards).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, init_std: float, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        rank, size = rank_and_size(tp_group)
        if vocab_size % size:
            raise ValueError(f"vocabulary of {vocab_size} does not split over {size} tensor-parallel ranks")
        self.vocab_start, self.local_vocab = rank * (vocab_size // size), vocab_size // size
        spec = ShardSpec((vocab_size, hidden_size), 0, None, rank, size)
        self.weight = annotate(nn.Parameter(torch.empty(self.local_vocab, hidden_size)), spec, init_std=init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.local_vocab)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(hidden, self.tp_group)
        return reduce_from_tp_region(hidden, self.tp_group)


# -- the loss --------------------------------------------------------------------------

class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group):
        rank, _ = rank_and_size(group)
        local_vocab = logits.shape[-1]
        # Subtracting the global max keeps exp() in range; it cancels in the loss and its gradient.
        logits_max = logits.max(dim=-1).values.float()
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.float() - logits_max.unsqueeze(-1)  # a fresh fp32 tensor, reused below
        local_labels = labels - rank * local_vocab
        outside = (local_labels < 0) | (local_labels >= local_vocab)
        local_labels = local_labels.masked_fill(outside, 0)
        target = shifted.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        sum_exp = shifted.exp_().sum(dim=-1)
        if group is not None:
            # One all-reduce for both sums: each is the sum of its per-rank parts.
            both = torch.stack([target, sum_exp])
            dist.all_reduce(both, group=group)
            target, sum_exp = both.unbind(0)
        softmax = shifted.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_labels, outside)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logit = softmax - one_hot(label), written into the saved softmax
        # (no second vocabulary-sized buffer; backward runs once).
        softmax, local_labels, outside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token cross-entropy [b, s] (fp32) of logits [b, s, v / TP] split over the vocabulary.

    No rank ever holds the full logits: the max, the sum of exponentials and the target
    logit are each reduced over the TP group. `labels` are ids in the full vocabulary.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        # Unsplit: PyTorch's own loss, which torch.compile fuses with the fp32 upcast (the
        # autograd function below would materialise several fp32 copies of the logits). The
        # losses own their storage (b x s floats): a model's output that is a view of another
        # tensor is one FSDP2's pre-backward hook can be lost on, and FSDP2 warns of it.
        losses = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
        return losses.view_as(labels).clone()
    return _VocabParallelCrossEntropy.apply(logits, labels, tp_group)

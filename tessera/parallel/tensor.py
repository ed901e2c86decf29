"""Tensor-parallel building blocks (Megatron-style): they become plain layers at TP=1.

Each layer stores only its shard of the weight and records how the shard is cut from
the full weight (`ShardSpec`), so that initialisation, checkpoints and Hugging Face
conversion can always work on the full, layout-independent tensor.

At TP=1 (`tp_group=None`) every layer is exactly nn.Linear / nn.Embedding and every
loss is F.cross_entropy; the tensor-parallel collectives are added by the parallelism
work (see tessera.parallel.mesh) without changing these interfaces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """How one rank's shard is cut from a full parameter.

    `segments` lists the sizes along `dim` of the blocks fused in one weight (for
    example q, k and v of a fused QKV projection); each block is split evenly over the
    tensor-parallel ranks, and a rank's shard is its piece of every block, concatenated.
    `dim=None` means the parameter is replicated on every tensor-parallel rank.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    segments: tuple[int, ...] | None = None
    rank: int = 0
    size: int = 1

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None or self.size == 1:
            return full
        segments = self.segments or (full.shape[self.dim],)
        pieces = []
        for block in torch.split(full, list(segments), dim=self.dim):
            pieces.append(torch.tensor_split(block, self.size, dim=self.dim)[self.rank])
        return torch.cat(pieces, dim=self.dim)


def _set_spec(param: nn.Parameter, spec: ShardSpec, init_std: float | None) -> None:
    param.shard_spec = spec
    param.init_std = init_std  # None: zeros for biases, ones for norm weights


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows over tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float,
                 segments: tuple[int, ...] | None = None, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        rank, size = _rank_size(tp_group)
        self.weight = nn.Parameter(torch.empty(out_features // size, in_features))
        _set_spec(self.weight, ShardSpec((out_features, in_features), 0, segments, rank, size), init_std)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // size))
            _set_spec(self.bias, ShardSpec((out_features,), 0, segments, rank, size), None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums reduced over ranks."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        rank, size = _rank_size(tp_group)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // size))
        _set_spec(self.weight, ShardSpec((out_features, in_features), 1, None, rank, size), init_std)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            _set_spec(self.bias, ShardSpec((out_features,)), None)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tensor-parallel ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, *, init_std: float, tp_group=None):
        super().__init__()
        self.tp_group = tp_group
        rank, size = _rank_size(tp_group)
        self.weight = nn.Parameter(torch.empty(vocab_size // size, hidden_size))
        _set_spec(self.weight, ShardSpec((vocab_size, hidden_size), 0, None, rank, size), init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token cross-entropy [b, s] of (vocab-sharded) logits [b, s, v], computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def _rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

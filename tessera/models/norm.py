"""LayerNorm or RMSNorm, replicated on every tensor-parallel rank."""

from __future__ import annotations

from torch import nn

from tessera.config import ModelConfig
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size


def build_norm(config: ModelConfig, tp_group=None, sequence_parallel: bool = False, width: int | None = None,
               eps: float | None = None) -> nn.Module:
    """A norm over `width` features (default the hidden size), replicated on every TP rank;
    `eps` defaults to --norm-epsilon.

    `sequence_parallel` marks its weights as seeing only this rank's part of the data (its
    sequence shard under SP, or its own heads for a per-head query/key norm): their
    gradients are partial sums over the TP group.
    """
    width, eps = width or config.hidden_size, eps or config.norm_epsilon
    if config.normalization == "RMSNorm":
        norm = nn.RMSNorm(width, eps=eps)
    else:
        norm = nn.LayerNorm(width, eps=eps, bias=True)
    rank, size = rank_and_size(tp_group)
    for name, param in norm.named_parameters():
        annotate(param, ShardSpec(tuple(param.shape), None, None, rank, size),
                 init_value=1.0 if name == "weight" else 0.0, sequence_parallel=sequence_parallel)
    return norm

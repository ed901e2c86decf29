"""LayerNorm or RMSNorm, replicated on every tensor-parallel rank; with --layernorm-zero-centered-gamma
their weights are centred on zero (the norm scales by 1 + weight: Megatron's layernorm_zero_centered_gamma,
Qwen3-Next's norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
    if config.layernorm_zero_centered_gamma:
        norm = ZeroCenteredNorm(width, eps, rms=config.normalization == "RMSNorm")
    elif config.normalization == "RMSNorm":
        norm = nn.RMSNorm(width, eps=eps)
    else:
        norm = nn.LayerNorm(width, eps=eps, bias=True)
    rank, size = rank_and_size(tp_group)
    for name, param in norm.named_parameters():
        scale = name == "weight" and not config.layernorm_zero_centered_gamma
        annotate(param, ShardSpec(tuple(param.shape), None, None, rank, size),
                 init_value=1.0 if scale else 0.0, sequence_parallel=sequence_parallel)
    return norm


class ZeroCenteredNorm(nn.Module):
    """RMSNorm or LayerNorm scaling by 1 + weight (weight starts at zero, and weight decay pulls the
    scale towards one). Not an nn.RMSNorm: kernels that fuse a plain norm's weight must not take it."""

    def __init__(self, width: int, eps: float, *, rms: bool):
        super().__init__()
        self.shape, self.eps, self.rms = (width,), eps, rms
        self.weight = nn.Parameter(torch.zeros(width))
        self.bias = None if rms else nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, self.shape, 1 + self.weight, self.eps)
        return F.layer_norm(x, self.shape, 1 + self.weight, self.bias, self.eps)

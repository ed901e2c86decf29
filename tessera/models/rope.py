"""Rotary position embedding: cos/sin tables and the rotation (rotate-half convention, as LLaMA/Megatron)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embedding."""

    def __init__(self, rotary_dim: int, base: float, max_positions: int):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Not saved in checkpoints: derived from the config.
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, seq_length: int, position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) shaped to broadcast over [batch, seq, heads, rotary_dim]."""
        if position_ids is None:
            return self.cos[:seq_length, None, :], self.sin[:seq_length, None, :]
        return self.cos[position_ids][:, :, None, :], self.sin[position_ids][:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [b, s, heads, d]; the rest pass through."""
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)
    return torch.cat([rotated, passed], dim=-1) if passed.shape[-1] else rotated

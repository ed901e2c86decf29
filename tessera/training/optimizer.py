"""AdamW with Megatron's weight-decay groups, and global gradient-norm clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera.config import OptimConfig


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; norms and biases (every 1-D parameter) get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2),
        eps=optim.adam_eps, fused=True if on_cuda else None, foreach=None if on_cuda else True,
    )


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def unscale_and_clip(params: list[torch.Tensor], inverse_scale: float, max_norm: float) -> float:
    """Unscale gradients, return their global L2 norm (inf/nan on overflow), clip if finite."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if inverse_scale != 1.0:
        torch._foreach_mul_(grads, inverse_scale)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0).item()
    if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
        torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
    return norm

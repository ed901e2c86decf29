"""AdamW with Megatron's weight-decay groups, and global gradient-norm clipping."""

from __future__ import annotations


import torch
from torch import nn

from tessera.config import OptimConfig


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """Fused AdamW; norms and biases (every 1-D parameter) get no weight decay."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.ndim == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, fused=True,
                             betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@torch.no_grad()
def grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients (a 0-d tensor; inf or nan on overflow)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)


@torch.no_grad()
def fused_step(optimizer: torch.optim.Optimizer, norm: torch.Tensor, loss_scale: float,
               max_norm: float) -> torch.Tensor:
    """Unscale, clip and step in the fused AdamW kernel; returns the unscaled grad norm.

    The fused kernel divides every gradient by `grad_scale` and skips the whole update
    when `found_inf` is set (the interface torch.amp.GradScaler uses). Folding the loss
    scale and the clip factor into it saves a pass over the gradients and, unlike
    clip_grad_norm_ + an overflow check, needs no device-to-host sync.
    """
    norm = norm / loss_scale
    clip = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
    optimizer.found_inf = (~torch.isfinite(norm)).float()
    optimizer.grad_scale = loss_scale / clip
    optimizer.step()
    return norm

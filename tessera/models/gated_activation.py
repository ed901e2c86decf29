"""Gated activations beyond plain SwiGLU: quick-GELU gates, an offset on the linear half, clamping
(GPT-OSS's experts; Megatron's --quick-geglu, --glu-linear-offset, --activation-func-clamp-value).

    out = act(min(gate, c)) * (clamp(up, -c, c) + offset),   hidden = [gate | up]
    act = gate * sigmoid(1.702 gate) (quick-GELU) or SiLU

as megatron.core.transformer.moe.experts computes it (and transformers' GptOssExperts with
alpha 1.702, limit 7, and the 1 added to up). In torch ops, which autograd and a compiled
block fuse; plain SwiGLU keeps its own kernels (tessera.kernels.swiglu).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUICK_GELU_ALPHA = 1.702


@dataclass(frozen=True)
class GatedActivation:
    quick: bool            # quick-GELU gate, else SiLU
    offset: float = 0.0    # added to the linear half
    clamp: float | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., 2 ffn] = [gate | up] -> [..., ffn], in hidden's dtype (computed in fp32 at least)."""
        gate, up = hidden.to(torch.promote_types(hidden.dtype, torch.float32)).chunk(2, dim=-1)
        if self.clamp is not None:
            gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
        act = gate * torch.sigmoid(QUICK_GELU_ALPHA * gate) if self.quick else F.silu(gate)
        return (act * (up + self.offset)).to(hidden.dtype)


def gated_activation(config) -> GatedActivation | None:
    """The activation a ModelConfig's gated MLP needs, or None where plain SwiGLU or GeLU is it."""
    if not (config.quick_geglu or config.glu_linear_offset or config.activation_func_clamp_value is not None):
        return None
    return GatedActivation(config.quick_geglu, config.glu_linear_offset, config.activation_func_clamp_value)

"""Squared ReLU, relu(x)^2 (arXiv 2109.08668; Megatron's --squared-relu, megatron/core/activations.py
`squared_relu`): the MLPs and experts of Nemotron-H. In torch ops, with no Triton kernel of its own.

    act = squared_relu(hidden)
    act = squared_relu_forward(hidden)                     # for tessera.kernels.activation_linear
    d_hidden, act = squared_relu_backward(grad, hidden)

A max and a product each way, which a compiled block fuses into its neighbours. Through
activation_linear the dense MLP still keeps fc1's output only, not the activation beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels.swiglu import compute_dtype


def squared_relu(hidden: torch.Tensor) -> torch.Tensor:
    return F.relu(hidden).square()


def squared_relu_forward(hidden: torch.Tensor) -> torch.Tensor:
    """relu(hidden)^2 computed in fp32 (at least), in hidden's dtype."""
    return squared_relu(hidden.to(compute_dtype(hidden))).to(hidden.dtype)


def squared_relu_backward(grad: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d hidden = grad x 2 relu(hidden), the activation recomputed), both in hidden's dtype."""
    positive = F.relu(hidden.to(compute_dtype(hidden)))
    return (grad.to(positive.dtype) * 2 * positive).to(hidden.dtype), positive.square().to(hidden.dtype)

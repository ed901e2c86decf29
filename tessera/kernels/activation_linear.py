"""The dense MLP's activation fused into fc2: act(hidden) W^T keeping fc1's output, not the activation.

    y = activation_linear(hidden, weight, "swiglu" | "gelu" | "gelu_tanh" | "squared_relu")
    x = activate(hidden, activation)   # the same activation in torch ops, for the unfused path

One autograd function around fc2's local GEMM: forward, one kernel for the activation, then
the GEMM; backward, d act = dy W, then one kernel reading fc1's output and d act that writes
d hidden and the activation again, then d W = dy^T act. A compiled block keeps the activation as
well as fc1's output; here the activation's memory is freed after fc2's GEMM (config A's peak
6 GiB lower, config B's 4.1). SwiGLU's compiled backward also ran at ~2.5 TB/s, its kernel here
near the copy rate. The kernels: tessera.kernels.swiglu, tessera.kernels.gelu (PyTorch ops
without CUDA and Triton); squared ReLU's are PyTorch ops everywhere (tessera.kernels.squared_relu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.kernels.gelu import gelu, gelu_backward, gelu_forward
from tessera.kernels.squared_relu import squared_relu, squared_relu_backward, squared_relu_forward
from tessera.kernels.swiglu import swiglu, swiglu_backward, swiglu_forward

# name -> (forward: hidden -> act, backward: (d act, hidden) -> (d hidden, act))
_KERNELS = {
    "swiglu": (swiglu_forward, swiglu_backward),
    "gelu": (lambda hidden: gelu_forward(hidden, False), lambda grad, hidden: gelu_backward(grad, hidden, False)),
    "gelu_tanh": (lambda hidden: gelu_forward(hidden, True), lambda grad, hidden: gelu_backward(grad, hidden, True)),
    "squared_relu": (squared_relu_forward, squared_relu_backward),
}
ACTIVATIONS = tuple(_KERNELS)


def activate(hidden: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation in torch ops (autograd, autocast, compile fuse it); SwiGLU's hidden is [gate | up]."""
    if activation == "swiglu":
        return swiglu(hidden)
    if activation == "squared_relu":
        return squared_relu(hidden)
    return gelu(hidden, tanh=activation == "gelu_tanh")


class _ActivationLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.leading, ctx.activation = hidden.shape[:-1], activation
        act = _KERNELS[activation][0](rows)
        # Not a view of a tensor made here: the caller's reduction over TP ranks works in place.
        return F.linear(act.view(*ctx.leading, act.shape[-1]), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad = grad.reshape(-1, weight.shape[0])
        d_hidden, act = _KERNELS[ctx.activation][1](grad @ weight, rows)
        return d_hidden.view(*ctx.leading, rows.shape[-1]), grad.t() @ act, None


def activation_linear(hidden: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """act(hidden) W^T of hidden [..., fc1's width] and W [out, act's width], in hidden's dtype (fp32
    weights under autocast are cast as autocast would)."""
    if activation not in _KERNELS:
        raise ValueError(f"unknown activation {activation!r}; one of {', '.join(ACTIVATIONS)}")
    return _ActivationLinear.apply(hidden, weight.to(hidden.dtype), activation)

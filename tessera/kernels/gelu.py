"""GeLU in one pass each way, for the dense MLP's activation fused into fc2
(tessera.kernels.activation_linear).

    act = gelu_forward(hidden, tanh)                 # GeLU(hidden), erf form or tanh-approximated
    d_hidden, act = gelu_backward(grad, hidden, tanh)

Both compute in fp32 and round to hidden's dtype. The backward also returns the activation,
recomputed, for fc2's weight gradient, so that the forward keeps fc1's output only.

Compiled, config A's block kept the activation for fc2's weight gradient beside fc1's output;
fused, it keeps fc1's output only: A's peak fell from 43.1 to 37.1 GiB on an H200. The time did
not move: these kernels take what Inductor's took (5.2 ms forward, 7.5 backward a step), the
forward at ~2.5 TB/s, under the copy rate; the erf form's arithmetic at the power-capped clock is
the likely bound (not checked with counters). Without CUDA and Triton the same maths runs in
PyTorch's own GeLU ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessera.kernels.swiglu import compute_dtype, on_triton

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

BLOCK = 1024   # elements a program


def gelu(hidden: torch.Tensor, *, tanh: bool) -> torch.Tensor:
    """GeLU in torch ops, tanh-approximated (--openai-gelu) or exact."""
    return F.gelu(hidden, approximate="tanh" if tanh else "none")


@torch.library.custom_op("tessera::gelu_forward", mutates_args=())
def gelu_forward(hidden: torch.Tensor, tanh: bool) -> torch.Tensor:
    """GeLU(hidden) in hidden's dtype."""
    if not on_triton(hidden):
        return gelu(hidden.to(compute_dtype(hidden)), tanh=tanh).to(hidden.dtype)
    act = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if hidden.numel():
        _forward_kernel[(triton.cdiv(hidden.numel(), BLOCK),)](hidden.contiguous(), act, hidden.numel(),
                                                              TANH=tanh, BLOCK=BLOCK)
    return act


@gelu_forward.register_fake
def _(hidden, tanh):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


@torch.library.custom_op("tessera::gelu_backward", mutates_args=())
def gelu_backward(grad: torch.Tensor, hidden: torch.Tensor, tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(d hidden, the activation recomputed), both in hidden's dtype."""
    if not on_triton(hidden):
        wide = hidden.to(compute_dtype(hidden))
        d_hidden = torch.ops.aten.gelu_backward(grad.to(wide.dtype), wide, approximate="tanh" if tanh else "none")
        return d_hidden.to(hidden.dtype), gelu(wide, tanh=tanh).to(hidden.dtype)
    d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    act = torch.empty_like(d_hidden)
    if hidden.numel():
        _backward_kernel[(triton.cdiv(hidden.numel(), BLOCK),)](
            grad.contiguous(), hidden.contiguous(), d_hidden, act, hidden.numel(), TANH=tanh, BLOCK=BLOCK)
    return d_hidden, act


@gelu_backward.register_fake
def _(grad, hidden, tanh):
    d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    return d_hidden, torch.empty_like(d_hidden)


if triton is not None:
    SQRT_HALF = tl.constexpr(math.sqrt(0.5))
    INV_SQRT_2PI = tl.constexpr(1 / math.sqrt(2 * math.pi))
    SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2 / math.pi))
    CUBIC = tl.constexpr(0.044715)   # the tanh form's coefficient

    @triton.jit
    def _gelu_and_slope(h, TANH: tl.constexpr):
        """GeLU(h) and its derivative in fp32. The tanh form through sigmoid: 1 + tanh(u) = 2 sigmoid(2u)."""
        if TANH:
            s = tl.sigmoid(2 * SQRT_2_OVER_PI * (h + CUBIC * h * h * h))
            slope = s + h * 2 * s * (1 - s) * SQRT_2_OVER_PI * (1 + 3 * CUBIC * h * h)
            return h * s, slope
        cdf = 0.5 * (1 + tl.erf(h * SQRT_HALF))
        return h * cdf, cdf + h * tl.exp(-0.5 * h * h) * INV_SQRT_2PI

    @triton.jit
    def _forward_kernel(hidden, act, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        value, _ = _gelu_and_slope(tl.load(hidden + at, mask=mask, other=0.0).to(tl.float32), TANH)
        tl.store(act + at, value.to(act.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(grad, hidden, d_hidden, act, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = at < n
        value, slope = _gelu_and_slope(tl.load(hidden + at, mask=mask, other=0.0).to(tl.float32), TANH)
        g = tl.load(grad + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(d_hidden + at, (g * slope).to(d_hidden.dtype.element_ty), mask=mask)
        tl.store(act + at, value.to(act.dtype.element_ty), mask=mask)

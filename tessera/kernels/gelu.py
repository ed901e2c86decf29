"""GeLU in one pass each way, for the dense MLP's activation fused into fc2
(tessera.kernels.activation_linear).

    act = gelu_forward(hidden, tanh)                 # GeLU(hidden), erf form or tanh-approximated
    d_hidden, act = gelu_backward(grad, hidden, tanh)

Both compute in fp32 and round to hidden's dtype. The backward also returns the activation,
recomputed, for fc2's weight gradient, so that the forward keeps fc1's output only.

Compiled, config A's block kept the activation for fc2's weight gradient beside fc1's output;
fused, it keeps fc1's output only: A's peak fell from 43.1 to 37.1 GiB on an H200.

The erf form is bound by instruction issue, not bandwidth: with libdevice's erf (a branchy
polynomial and an exp of its own, beside the slope's exp) the forward ran at 2.76 TB/s on an
H200. The normal tail written as exp(-h^2/2) times a polynomial (below), one exp for value and
slope, took A's 16384x8192 forward from 195 to 167 us (3.22 TB/s) and the backward from 271 to
258: a step's GeLU from 11.2 to 10.2 ms (docs/performance-notes.md, 2026-12-04). fc1's bias added
here and its gradient summed in the backward's pass was tried and not kept: the column sums
slowed the backward by more than the separate sum's 70 us. Without CUDA and Triton the same
maths runs in PyTorch's own GeLU ops.
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
        # The normal distribution's tail q = P(X > |h|) = exp(-h^2 / 2) R(t), R a polynomial in
        # t = 1 / (1 + 0.28 |h|) (a least-squares fit of erfcx(|h| / sqrt 2) / 2 in relative error
        # over |h| <= 9): one exp, shared with the slope, and a division, where tl.erf is libdevice's
        # branchy polynomial plus an exp of its own. Relative error ~2e-6 in fp32; for every finite
        # bf16 input the bf16 result is the correctly rounded GeLU (tests/gpu/test_activation_linear_cuda.py).
        t = 1 / (1 + 0.28 * tl.abs(h))
        r = 0.04083008 * t - 0.22428705
        r = r * t + 0.41751087
        r = r * t - 0.28235996
        r = r * t + 0.27666497
        r = r * t + 0.03496692
        r = r * t + 0.12676349
        r = r * t + 0.10980681
        r = r * t + 0.00010382024
        density = tl.exp(-0.5 * h * h)
        tail = r * density
        cdf = tl.where(h >= 0, 1 - tail, tail)
        return h * cdf, cdf + h * density * INV_SQRT_2PI

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

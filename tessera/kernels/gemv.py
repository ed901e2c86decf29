"""x W^T for one row of x: Triton GEMVs for the decode step of a single request.

    y = linear(x, weight, bias)                         # F.linear, with `gemv` when x is one row on CUDA
    y = gemv(x, weight)                                 # [K] -> [N]
    hidden, y = norm_gemv(residual, delta, norm_weight, eps, weight)   # RMSNorm(residual + delta) W^T
    y = swiglu_gemv(gate_up, weight)                    # (SiLU(gate) * up) W^T

At batch 1 every linear layer is a matrix-vector product: all it does is read the weight
once. cuBLAS reads config B's smaller weights (2048 x 2048, 3072 x 2048, 2048 x 5632) at
1.4-2.1 TB/s on an H200 (its tile shapes leave SMs idle or need a split-K reduction
kernel); a kernel that gives each program a few whole rows and streams them along K reads
them at 2.1-2.9 TB/s with one launch (bench numbers in docs/performance-notes.md). The row block
and the K step are tuned per weight shape (triton.autotune on the first call of each shape);
a K step of a whole 2048-wide row won 5% over the narrower ones in a decode step's chain.

Between two kernels of a chain the GPU idles while the second launches and ramps up; at
~2-4 us a GEMV that is a large part of it. On Hopper and later every kernel of this module
and of tessera.kernels.paged_decode is launched with programmatic dependent launch (PDL,
`launch_pdl`): each program first lets the next kernel launch (`gdc_launch_dependents`),
then waits for the previous one to finish and flush its writes (`gdc_wait`) before it reads
anything, so the next kernel's programs are resident and waiting when this one ends. Every
program waits, so a kernel ends only after the one before it: kernels launched without PDL
(torch's) order as usual. Measured on an H200 over a decode step's 97 GEMVs in one CUDA
graph: 774 -> 734 us (triggering after the wait: 743; at the end: 795; prefetching the
weight's first columns into L2 before the wait: slower, 776-830).

The prologue variants fold the small kernels between two GEMVs into the second one: each
program computes the input row it needs (a few KB, from L2) as it streams its rows of W.
`norm_gemv` adds the residual branch and applies the RMSNorm (program 0 also writes the new
residual stream) in the same pass as the GEMV: sum_k W[n, k] w_k h_k is accumulated beside
sum_k h_k^2 and scaled by the norm's 1 / rms at the end, so the weight's loads never wait for
the norm (a first pass for the statistics made these GEMVs ~1.5 us slower each on an H200).
`swiglu_gemv` applies the SwiGLU activation of fc1's [gate | up] output. They round where
the model's bf16 ops round (the residual sum, SiLU, the product) except the norm's output,
which enters the fp32 product unrounded: within bf16's rounding of the unfused layer.
Elsewhere (CPU, several rows, autograd, autocast) `linear` is F.linear; the fused forms run on
CUDA only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

PLAIN, RMSNORM, SWIGLU = 0, 1, 2   # the kernel's prologues


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with programmatic dependent launch (Hopper and later)."""
    return x.is_cuda and _hopper_or_later(x.device.index if x.device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_later(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if triton is not None and x.is_cuda and x.numel() == x.shape[-1] and x.dtype == weight.dtype \
            and weight.stride(-1) == 1 and not torch.is_autocast_enabled("cuda") \
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        y = gemv(x.reshape(-1), weight).view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def wait_for_previous_kernel(PDL: tl.constexpr):
        """The start of a kernel launched with PDL: the next kernel may launch; this one's reads wait."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.autotune(configs=[triton.Config(dict(ROWS=rows, STEP=step), num_warps=warps)
                              for rows, step, warps in ((4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4),
                                                        (16, 512, 8), (4, 1024, 8), (8, 1024, 8), (32, 128, 4),
                                                        (2, 1024, 4), (1, 2048, 4), (2, 2048, 4), (4, 2048, 4),
                                                        (4, 2048, 8), (8, 2048, 8))],
                     key=["N", "K", "PROLOGUE"])
    @triton.jit
    def _gemv_kernel(x_ptr, delta_ptr, norm_ptr, hidden_ptr, w_ptr, out_ptr, N, w_stride, eps,
                     K: tl.constexpr, PROLOGUE: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr,
                     STEP: tl.constexpr):
        wait_for_previous_kernel(PDL)
        program = tl.program_id(0)
        dtype = x_ptr.dtype.element_ty
        rows = program * ROWS + tl.arange(0, ROWS)
        acc = tl.zeros([ROWS, STEP], tl.float32)
        squares = tl.zeros([STEP], tl.float32)
        for start in range(0, K, STEP):   # one pass: the weight's loads never wait for the input's
            k = start + tl.arange(0, STEP)
            w = tl.load(w_ptr + rows[:, None] * w_stride + k[None, :], mask=(rows[:, None] < N) & (k[None, :] < K),
                        other=0.0)
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            if PROLOGUE == 1:    # hidden = x + delta; RMSNorm's scale comes after the sum
                hidden = (x.to(tl.float32) + tl.load(delta_ptr + k, mask=k < K, other=0.0).to(tl.float32)).to(dtype)
                tl.store(hidden_ptr + k, hidden, mask=(k < K) & (program == 0))
                squares += hidden.to(tl.float32) * hidden.to(tl.float32)
                x = hidden.to(tl.float32) * tl.load(norm_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            elif PROLOGUE == 2:  # SiLU(gate) * up, gate = x[:K], up = x[K:]
                gate = x.to(tl.float32)
                up = tl.load(x_ptr + K + k, mask=k < K, other=0.0).to(tl.float32)
                x = ((gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up).to(dtype)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        out = tl.sum(acc, 1)
        if PROLOGUE == 1:
            out = out * tl.rsqrt(tl.sum(squares, 0) / K + eps)
        tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)

    def _launch(x, weight, prologue: int, delta=None, norm_weight=None, hidden=None, eps: float = 0.0):
        n, k = weight.shape
        out = torch.empty(n, dtype=x.dtype, device=x.device)
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["ROWS"]),)](
            x, x if delta is None else delta, x if norm_weight is None else norm_weight,
            out if hidden is None else hidden, weight, out, n, weight.stride(0), eps, K=k, PROLOGUE=prologue,
            PDL=pdl(x), launch_pdl=pdl(x))
        return out

    @torch.library.custom_op("tessera::gemv", mutates_args=())
    def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [K], weight [N, K] (rows contiguous) -> [N] in x's dtype, accumulated in fp32."""
        return _launch(x.contiguous(), weight, PLAIN)

    @gemv.register_fake
    def _(x, weight):
        return x.new_empty(weight.shape[0])

    @torch.library.custom_op("tessera::norm_gemv", mutates_args=())
    def norm_gemv(residual: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual, delta [K] -> (hidden = residual + delta, RMSNorm(hidden) * norm_weight @ weight^T [N])."""
        hidden = torch.empty_like(residual)
        out = _launch(residual.contiguous(), weight, RMSNORM, delta.contiguous(), norm_weight, hidden, eps)
        return hidden, out

    @norm_gemv.register_fake
    def _(residual, delta, norm_weight, eps, weight):
        return torch.empty_like(residual), residual.new_empty(weight.shape[0])

    @torch.library.custom_op("tessera::swiglu_gemv", mutates_args=())
    def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """gate_up [2K] ([gate | up], fc1's output) -> (SiLU(gate) * up) @ weight^T [N]."""
        return _launch(gate_up.contiguous(), weight, SWIGLU)

    @swiglu_gemv.register_fake
    def _(gate_up, weight):
        return gate_up.new_empty(weight.shape[0])

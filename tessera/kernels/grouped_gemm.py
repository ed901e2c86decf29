"""The MoE experts' grouped GEMMs: quack's variable-length GEMMs where installed, else torch._grouped_mm.

    out = grouped_linear(x, weight, bounds)   # x [rows, in], weight [groups, out, in] -> [rows, out]

Group g is rows bounds[g]:bounds[g + 1] of x (bounds [groups + 1], int32, from 0 to rows),
multiplied by weight[g]^T: each expert's linear layer over the rows routed to it. The
backward is two more grouped GEMMs: d x by the same groups of rows, d weight contracting
over each group's rows.

On an H200, the `quack-kernels` package's CuTe-DSL GEMMs over variable-length groups (its
`cu_seqlens_m` / `cu_seqlens_k` forms, the default configuration, compiled once per shape and
cached) ran config M's expert GEMMs 3-16% faster than torch._grouped_mm in bf16 with the group
sizes routing gives, with the same results, and config M's training step 3.7% faster
(docs/performance-notes.md; with exactly even groups the input gradients were slower, and the coarse
config C's GEMMs, which cuBLAS-class kernels already run well, equal). So on Hopper, in bf16,
with widths that keep rows 16-byte aligned, tessera takes them when the package is installed
(`pip install tessera[moe]`); everywhere else, and for any other dtype, torch._grouped_mm, as
before. Blackwell would run quack's kernels too but is not measured here, so it keeps PyTorch's.
Both directions are custom ops, so compiled blocks keep them opaque.
"""

from __future__ import annotations

import functools

import torch


@torch.library.custom_op("tessera::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """x [rows, in] in the groups that `bounds` [groups + 1] cuts, weight [groups, out, in] -> [rows, out]."""
    return rows_times_groups(x, weight.transpose(1, 2), bounds)


@grouped_linear.register_fake
def _(x, weight, bounds):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("tessera::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_linear's gradients: d x [rows, in] and d weight [groups, out, in]."""
    grad = grad.contiguous()
    return rows_times_groups(grad, weight, bounds), group_products(grad, x, bounds)


@grouped_linear_backward.register_fake
def _(grad, x, weight, bounds):
    return torch.empty_like(x), torch.empty_like(weight)


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return *grouped_linear_backward(grad, *ctx.saved_tensors), None


grouped_linear.register_autograd(_backward, setup_context=_save)


def rows_times_groups(a: torch.Tensor, b: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """a [rows, k] in groups, b [groups, k, n] -> [rows, n]: each group's rows times its matrix."""
    quack_gemm = _quack(a, b)
    if quack_gemm is not None:
        return quack_gemm(a, b, cu_seqlens_m=bounds, tuned=False)
    return torch._grouped_mm(a, b, offs=bounds[1:])


def group_products(grad: torch.Tensor, x: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """grad [rows, m], x [rows, n] in groups -> [groups, m, n]: grad_g^T x_g, contracting over each group's rows."""
    quack_gemm = _quack(grad, x)
    if quack_gemm is not None:
        return quack_gemm(grad.t(), x, cu_seqlens_k=bounds, tuned=False)
    return torch._grouped_mm(grad.t(), x, offs=bounds[1:])


def _quack(a: torch.Tensor, b: torch.Tensor):
    """quack's gemm if it runs these operands (bf16 on a Hopper GPU, 16-byte aligned widths, some
    rows), else None."""
    if not (a.is_cuda and a.dtype == b.dtype == torch.bfloat16 and a.numel() and b.numel()):
        return None
    if a.shape[-1] % 8 or b.shape[-1] % 8 or not _hopper(a.device.index):
        return None
    return _quack_gemm()


@functools.cache
def _hopper(device_index: int | None) -> bool:
    """Whether the GPU is a Hopper, asked once a device: this runs for each of a step's GEMMs."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


@functools.cache
def _quack_gemm():
    """quack.gemm_interface.gemm, imported once, or None without the package."""
    try:
        from quack.gemm_interface import gemm
    except ImportError:
        return None
    return gemm

"""The greedy token of each row of logits, written in place: one Triton program per row.

    argmax_into(logits, columns, out)    # out[r] = logits[r, :columns].argmax()

The greedy CUDA graphs (tessera.inference.cuda_graphs) end each step with it. torch's argmax
over a row of 32,000 logits is a 12 us reduction on an H200, more than a 2048 x 2048 GEMV;
a program reading its whole row at once takes a few. Ties go to the first index, as with
torch.argmax (a NaN is not treated as the maximum, as torch does: greedy logits are finite).
Elsewhere (CPU, no Triton) it is torch.argmax.
"""

from __future__ import annotations

import torch

from tessera.kernels.gemv import pdl

try:
    import triton
    import triton.language as tl

    from tessera.kernels.gemv import wait_for_previous_kernel
except ImportError:   # CPU-only torch ships without Triton
    triton = None


def argmax_into(logits: torch.Tensor, columns: int, out: torch.Tensor) -> torch.Tensor:
    """logits [rows, >= columns] -> out [rows] int64 (written, and returned)."""
    if triton is None or not logits.is_cuda or logits.stride(-1) != 1:
        return out.copy_(logits[:, :columns].argmax(dim=-1))
    _argmax_kernel[(logits.shape[0],)](logits, out, logits.stride(0), COLUMNS=columns,
                                       BLOCK=triton.next_power_of_2(columns), PDL=pdl(logits), num_warps=16,
                                       launch_pdl=pdl(logits))
    return out


if triton is not None:

    @triton.jit
    def _argmax_kernel(logits_ptr, out_ptr, row_stride, COLUMNS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        column = tl.arange(0, BLOCK)
        values = tl.load(logits_ptr + row * row_stride + column, mask=column < COLUMNS, other=float("-inf"))
        tl.store(out_ptr + row, tl.argmax(values.to(tl.float32), 0, tie_break_left=True).to(tl.int64))


"""Each token's sum of its k rows, gathered: the MoE permutation's sums (tessera.parallel.experts).

    out = sum_pairs(rows, pairs)   # out[t] = rows[pairs[t, 0]] + ... + rows[pairs[t, k - 1]]

rows [P, h], pairs [T, k] int64 row indices; the sum is taken in fp32 in that order and rounded
once to rows' dtype. `sum_pairs_in_torch` is the same maths as torch ops, written as k gathers
added in turn (as an index then a sum over k, Inductor made a reduction over a strided axis
that ran at ~1 TB/s on an H200).

Two places sum pairs: the experts' outputs back on their tokens (combine's forward) and the
gradients of a token's k copies (dispatch's backward). The first stays in torch ops, so that a
compiled block fuses it with the residual add that follows (3.4 TB/s on config M). The second
met the backward of the RMSNorm before the MoE layer: Inductor fused both into one looped
reduction that gathered each token's k rows once per loop (1.79 ms of config M's step, ~2 TB/s).
`sum_pairs` is a custom op, opaque to Inductor, whose Triton kernel reads each row once; the
norm's backward then reads the [T, h] sum.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

BLOCK = 1024   # columns a program adds up


def sum_pairs_in_torch(rows: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """sum_pairs's maths in torch ops: k gathers added in turn in fp32, rounded once."""
    total = rows[pairs[:, 0]].float()
    for j in range(1, pairs.shape[1]):
        total = total + rows[pairs[:, j]]
    return total.to(rows.dtype)


@torch.library.custom_op("tessera::sum_pairs", mutates_args=())
def sum_pairs(rows: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """out[t] = the fp32 sum of rows[pairs[t, j]] over j in order, in rows' dtype."""
    if triton is None or not rows.is_cuda or not rows.numel() or not pairs.numel():
        return sum_pairs_in_torch(rows, pairs)
    rows, pairs = rows.contiguous(), pairs.contiguous()
    tokens, width = pairs.shape[0], rows.shape[1]
    out = rows.new_empty(tokens, width)
    _sum_pairs_kernel[(tokens, triton.cdiv(width, BLOCK))](rows, pairs, out, width, K=pairs.shape[1], BLOCK=BLOCK)
    return out


@sum_pairs.register_fake
def _(rows, pairs):
    return rows.new_empty(pairs.shape[0], rows.shape[1])


if triton is not None:
    @triton.jit
    def _sum_pairs_kernel(rows, pairs, out, width, K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < width
        first = tl.load(pairs + token * K)
        total = tl.load(rows + first * width + columns, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            row = tl.load(pairs + token * K + j)
            total += tl.load(rows + row * width + columns, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + token * width + columns, total.to(out.dtype.element_ty), mask=mask)

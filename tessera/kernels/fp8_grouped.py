"""FP8 grouped GEMMs for the MoE experts, over torch._scaled_grouped_mm, scaled per row.

One expert layer's GEMM y = x W_e^T (x: rows grouped by expert, W: [experts, out, in]) and
its two backward GEMMs run with E4M3 operands:

    forward      y  = x  W_e^T     x scaled per row, W per (expert, output column)
    input grad   dx = dy W_e       dy per row, W per (expert, input column)
    weight grad  dW_e = dy_e^T x_e  dy per column, x per column (the groups along the
                                   contracted rows: one scale a column, the same for every group)

Scales are current (each tensor's amax now) whatever --fp8-recipe says, and gradients are E4M3
too: on Hopper torch's grouped FP8 GEMM takes one scale per row or column (CUTLASS), not one per
tensor or 128-block, and a row's own scale keeps each token's values in range whatever the
other tokens do (torchao's MoE recipe does the same). Every GEMM runs with fast accumulation
(`use_fast_accum`), as torchao's grouped recipe does. The backward keeps the bf16 x and W, as
tessera.kernels.fp8's linears do, and casts again.

The weight gradient contracts over each group's rows, and FP8 GEMMs contract in 16-byte steps,
so every group gets a multiple of 16 rows (the alignment torchtitan gives FP8 groups):
`padded_groups` is the layout GroupedExperts runs the experts in. Elsewhere
than CUDA the same quantised operands are dequantised and multiplied in fp32 group by group
(what the CPU tests check the plumbing against).
"""

from __future__ import annotations

import torch

from tessera.kernels.fp8 import E4M3, quantize, scale_for

GROUP_ROWS = 16   # FP8 grouped GEMMs contract over whole 16-byte rows of FP8 values


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in E4M3 with one scale per slice along the last dimension (its amax maps to 448),
    laid out row-major; and the dequantising scales, that dimension dropped."""
    scale = scale_for(x.detach().abs().amax(dim=-1, keepdim=True), E4M3)
    return quantize(x, scale, E4M3).contiguous(), (1 / scale).squeeze(-1)


def padded_groups(tokens_per_expert: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The layout with each expert's rows padded to a multiple of GROUP_ROWS: where each of the
    `rows` rows goes, each group's end, and the padded total. The total is a bound that does
    not depend on the routing (a static shape, and no host sync): the last group ends there,
    so every row belongs to a group and the padding rows, zeros, compute zeros."""
    experts = tokens_per_expert.numel()
    total = -(-rows // GROUP_ROWS) * GROUP_ROWS + GROUP_ROWS * experts
    counts = tokens_per_expert.to(torch.int64)
    padded = (counts + GROUP_ROWS - 1) // GROUP_ROWS * GROUP_ROWS
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)   # padded start - start
    where = torch.arange(rows, device=counts.device) + torch.repeat_interleave(shift, counts, output_size=rows)
    ends = torch.cat([padded.cumsum(0)[:-1], padded.new_full((1,), total)])
    return where, ends.to(torch.int32), total


def fp8_grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, fp8_wgrad: bool = True
                       ) -> torch.Tensor:
    """x [rows, in] (grouped by expert, `ends` int32 each group's end, multiples of 16) times
    each group's weight [experts, out, in] transposed: [rows, out] in x's dtype."""
    return _Fp8GroupedMatmul.apply(x, weight, ends, fp8_wgrad)


class _Fp8GroupedMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, fp8_wgrad: bool):
        x8, x_scale = quantize_rows(x)
        w8, w_scale = quantize_rows(weight)   # [E, out, in]: its transpose is column-major, as the GEMM wants
        ctx.save_for_backward(x, weight, ends)
        ctx.fp8_wgrad = fp8_wgrad
        return _scaled_grouped_mm(x8, w8.transpose(1, 2), x_scale, w_scale, ends, x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        experts = weight.shape[0]
        g8, g_scale = quantize_rows(grad)
        wt8, wt_scale = quantize_rows(weight.transpose(1, 2))   # [E, in, out], scaled per input column
        grad_x = _scaled_grouped_mm(g8, wt8.transpose(1, 2), g_scale, wt_scale, ends, x.dtype)
        if ctx.fp8_wgrad:
            gt8, gt_scale = quantize_rows(grad.t())   # [out, rows]
            xt8, xt_scale = quantize_rows(x.t())      # [in, rows]: its transpose is column-major
            grad_w = _scaled_grouped_mm(gt8, xt8.t(), gt_scale.repeat(experts), xt_scale.repeat(experts), ends,
                                        weight.dtype)
        else:
            grad_w = _grouped_mm(grad.t(), x, ends).to(weight.dtype)
        return grad_x, grad_w, None, None


def _scaled_grouped_mm(a8: torch.Tensor, b8: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                       ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a8 @ b8 per group with dequantising scales. 2D x 3D: a [rows, k] grouped along its rows,
    b [E, k, n], scales (rows,) and (E, n). 2D x 2D: a [m, rows], b [rows, n], grouped along the
    contracted rows, scales (E m,) and (E n,); the output [E, m, n]."""
    if a8.is_cuda:
        return torch._scaled_grouped_mm(a8, b8, a_scale, b_scale, ends, out_dtype=out_dtype, use_fast_accum=True)
    if b8.ndim == 3:
        a = a8.float() * a_scale[:, None]
        b = b8.float() * b_scale[:, None, :]
        return _grouped_mm(a, b, ends).to(out_dtype)
    experts = ends.numel()
    a = a8.float() * a_scale.view(experts, -1)[:, :, None]   # [E, m, rows]
    b = b8.float() * b_scale.view(experts, 1, -1)            # [E, rows, n]
    return torch.stack([a[e, :, s:t] @ b[e, s:t] for e, (s, t) in enumerate(_groups(ends))]).to(out_dtype)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a @ b per group in a's dtype: 2D x 3D along a's rows, or 2D x 2D along the contracted
    rows; torch._grouped_mm on CUDA, a loop over the groups elsewhere."""
    if a.is_cuda:
        return torch._grouped_mm(a, b, offs=ends)
    if b.ndim == 3:
        return torch.cat([a[s:t] @ b[e] for e, (s, t) in enumerate(_groups(ends))])
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in _groups(ends)])


def _groups(ends: torch.Tensor) -> list[tuple[int, int]]:
    """Each group's (start, end) row, from the groups' ends (a host read: the CPU path only)."""
    ends = ends.tolist()
    return list(zip([0] + ends[:-1], ends))

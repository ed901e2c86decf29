"""The MoE experts' grouped GEMMs alone: torch's and tessera's bf16, FP8 rowwise, against a dense GEMM.

    python bench/grouped_gemm.py [--config M|C] [--tokens 8192]

For the bench configs' expert layers (hidden 2048; M: 64 experts of ffn 768, top-8; C: 8 of
5632, top-2), rows = tokens x top-k split evenly over the experts. Times, by CUDA events,
each GEMM a step runs per layer as autograd runs it: fc1 and fc2 forward (2D x 3D), their
input gradients (2D x 3D, the weight row-major) and weight gradients (2D x 2D, groups along
the contracted rows), in bf16 through torch._grouped_mm and through what tessera runs
(tessera.kernels.grouped_gemm: quack's GEMMs where installed), and with FP8 e4m3 operands
scaled per row (torch._scaled_grouped_mm; the quantisation itself is not timed). Prints
TFLOP/s per GEMM and what a step's 12 layers spend.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm import timed  # noqa: E402
from tessera.kernels.grouped_gemm import group_products, rows_times_groups  # noqa: E402

SHAPES = {"M": dict(experts=64, ffn=768, topk=8), "C": dict(experts=8, ffn=5632, topk=2)}
HIDDEN, LAYERS = 2048, 12
FP8 = torch.float8_e4m3fn


def rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x in FP8 with one scale per slice along `dim` reduced (amax / 448), and the dequant scales."""
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = amax / torch.finfo(FP8).max
    return (x.float() / scale).to(FP8), scale.squeeze(dim)


def column_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-2, -1).contiguous().transpose(-2, -1)


def cases(experts: int, ffn: int, rows: int):
    """(name, flops, torch bf16 call, tessera bf16 call, fp8 call) for the six GEMMs of one expert layer."""
    offsets = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * (rows // experts)
    bounds = torch.nn.functional.pad(offsets, (1, 0))
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    d_fc1_out = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    d_out = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    fc1 = torch.randn(experts, 2 * ffn, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
    fc2 = torch.randn(experts, HIDDEN, ffn, device="cuda", dtype=torch.bfloat16) / ffn**0.5
    gmm = torch._grouped_mm

    def fp8_2d3d(a, b_t):   # a [R, K] rowwise; b_t [E, K, N] column-major, scaled per output column
        qa, sa = rowwise(a, -1)
        qb, sb = rowwise(b_t, -2)
        qb = column_major(qb)
        return lambda: torch._scaled_grouped_mm(qa, qb, sa, sb, offsets, out_dtype=torch.bfloat16, use_fast_accum=True)

    def fp8_2d2d(a_t, b):   # a_t [N, R] row-major, b [R, K] column-major; one scale a row per group
        qa, sa = rowwise(a_t, -1)
        qb, sb = rowwise(b.t(), -1)
        qb = qb.contiguous().t()
        sa, sb = sa.repeat(experts), sb.repeat(experts)
        return lambda: torch._scaled_grouped_mm(qa, qb, sa, sb, offsets, out_dtype=torch.bfloat16, use_fast_accum=True)

    f1, f2 = 2 * rows * HIDDEN * 2 * ffn, 2 * rows * ffn * HIDDEN
    rows_x, groups_x = rows_times_groups, group_products
    return [
        ("fc1 forward", f1, lambda: gmm(x, fc1.transpose(1, 2), offs=offsets),
         lambda: rows_x(x, fc1.transpose(1, 2), bounds), lambda: fp8_2d3d(x, fc1.transpose(1, 2))),
        ("fc2 forward", f2, lambda: gmm(hidden, fc2.transpose(1, 2), offs=offsets),
         lambda: rows_x(hidden, fc2.transpose(1, 2), bounds), lambda: fp8_2d3d(hidden, fc2.transpose(1, 2))),
        ("fc1 input grad", f1, lambda: gmm(d_fc1_out, fc1, offs=offsets), lambda: rows_x(d_fc1_out, fc1, bounds),
         lambda: fp8_2d3d(d_fc1_out, column_major(fc1))),
        ("fc2 input grad", f2, lambda: gmm(d_out, fc2, offs=offsets), lambda: rows_x(d_out, fc2, bounds),
         lambda: fp8_2d3d(d_out, column_major(fc2))),
        ("fc1 weight grad", f1, lambda: gmm(d_fc1_out.t(), x, offs=offsets), lambda: groups_x(d_fc1_out, x, bounds),
         lambda: fp8_2d2d(d_fc1_out.t().contiguous(), x)),
        ("fc2 weight grad", f2, lambda: gmm(d_out.t(), hidden, offs=offsets), lambda: groups_x(d_out, hidden, bounds),
         lambda: fp8_2d2d(d_out.t().contiguous(), hidden)),
    ], x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(SHAPES), default="M")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens a step (M: 4 x 2048; C: 8 x 2048)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    shape = SHAPES[args.config]
    rows = args.tokens * shape["topk"]
    table, x = cases(shape["experts"], shape["ffn"], rows)
    print(f"config {args.config}: {shape['experts']} experts of {shape['ffn']}, {rows} rows, hidden {HIDDEN}")
    print(f"{'GEMM':<16} {'torch ms':>8} {'TFLOP/s':>8} {'tessera':>8} {'TFLOP/s':>8} {'fp8 ms':>8} {'TFLOP/s':>8}")
    totals = [0.0, 0.0, 0.0]
    for name, flops, bf16, ours, fp8 in table:
        seconds, our_seconds = timed(bf16, args.repeats), timed(ours, args.repeats)
        try:
            fp8_seconds, fp8_text = timed(fp8(), args.repeats), ""
        except (RuntimeError, ValueError) as error:   # a layout or scale shape the installed torch refuses
            fp8_seconds, fp8_text = float("nan"), str(error).splitlines()[0][:100]
        totals[0] += seconds
        totals[1] += our_seconds
        totals[2] += fp8_seconds
        print(f"{name:<16} {seconds * 1e3:8.3f} {flops / seconds / 1e12:8.0f} {our_seconds * 1e3:8.3f} "
              f"{flops / our_seconds / 1e12:8.0f} {fp8_seconds * 1e3:8.3f} {flops / fp8_seconds / 1e12:8.0f} {fp8_text}")
    dense = torch.randn(HIDDEN, 2 * shape["ffn"], device="cuda", dtype=torch.bfloat16)
    dense_seconds = timed(lambda: x @ dense, args.repeats)
    dense_rate = 2 * rows * HIDDEN * dense.shape[1] / dense_seconds / 1e12
    print(f"dense x @ [{HIDDEN}, {dense.shape[1]}] (fc1 forward's FLOPs as one GEMM): {dense_rate:.0f} TFLOP/s")
    print(f"a step's {LAYERS} layers: torch bf16 {totals[0] * LAYERS * 1e3:.1f} ms, tessera bf16 "
          f"{totals[1] * LAYERS * 1e3:.1f} ms, fp8 {totals[2] * LAYERS * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

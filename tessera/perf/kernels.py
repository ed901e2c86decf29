"""How fast one GPU runs the kernels of a training step: GEMMs, fused attention, memory-bound ops.

Three curves, each with one or two physical parameters:

- GEMM: a Hopper GEMM tiles its m x n output into 128 x 256 blocks, one per SM at a time,
  and streams k through each block. So it loses (a) to the last, partly idle wave of
  tiles (m x n small against 132 SMs) and (b) to the fixed fill/drain of each tile when k
  is short: efficiency = e_max * wave_fill(m, n) * k / (k + k0). A GEMM is also never
  faster than reading its operands from HBM.
- Fused (flash/cuDNN) causal attention: efficiency rises with the sequence as the
  masked diagonal blocks matter less: a_max * s / (s + s0), on the FLOPs it really does
  (half the s x s scores forward, 2.5x forward for backward with recomputed scores).
  With dropout it also draws a random number per score, which costs extra time.
- Memory-bound ops (norms, activations, residuals, optimizer): bytes / (HBM x efficiency).

FP8 GEMMs use the GEMM curve at the FP8 peak, e_max scaled per recipe by measured rates
(FP8_GEMM_EFFICIENCY; tessera.perf.fp8 adds their quantisation passes).

A grouped GEMM (MoE experts, one group per local expert) runs every group's tiles in one
launch, so its waves are counted over all of them; each group keeps its own short-k
cost. That it reaches the dense curve otherwise is an estimate (not measured here).

The parameters come from bench/gemm.py's measurement on an H200 when that JSON exists
(tessera/perf/data/gemm_h200.json, or any file given with --gemm-curve); until then from
PROVISIONAL below, derived from Megatron-Core's measured reference runs. H100 SXM and H200
share the GH100 chip and its rates, so one curve serves both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

TILE_M, TILE_N = 128, 256
MEASURED_CURVE = Path(__file__).with_name("data") / "gemm_h200.json"


@dataclass(frozen=True)
class KernelCurves:
    source: str          # where the numbers come from, printed by --explain
    sms: int             # streaming multiprocessors (132 on H100 SXM / H200)
    gemm_max: float      # e_max: fraction of dense peak on large, well-shaped GEMMs
    gemm_k0: float       # k at which short-k fill/drain halves the efficiency
    attn_max: float      # a_max: fused causal attention at long sequences
    attn_s0: float       # sequence length at which attention reaches half of a_max
    hbm_efficiency: float  # fraction of datasheet HBM bandwidth that copies reach
    # Extra attention time with dropout: the kernel draws a Philox random number per
    # score, forward and again in backward, on the CUDA cores. For head dimension 128
    # that is about half the tensor-core time per score (an estimate until measured).
    attn_dropout_cost: float = 0.5

    def wave_fill(self, m: int, n: int, groups: int = 1) -> float:
        """Fraction of SM slots busy over the waves of output tiles (best tile orientation)."""
        best = 0.0
        for rows, cols in ((TILE_M, TILE_N), (TILE_N, TILE_M)):
            tiles = groups * math.ceil(m / rows) * math.ceil(n / cols)
            best = max(best, tiles / (math.ceil(tiles / self.sms) * self.sms))
        return best

    def gemm_efficiency(self, m: int, n: int, k: int, groups: int = 1) -> float:
        return self.gemm_max * self.wave_fill(m, n, groups) * k / (k + self.gemm_k0)

    def gemm_time(self, m: int, n: int, k: int, peak_flops: float, hbm_bytes_per_s: float,
                  bytes_per_element: int = 2, groups: int = 1) -> float:
        """Seconds for one (m x k) @ (k x n) GEMM, compute- or memory-bound; with `groups`, a
        grouped GEMM of that many such products, whose tiles share the SMs' waves."""
        compute = 2.0 * groups * m * n * k / (peak_flops * self.gemm_efficiency(m, n, k, groups))
        memory = groups * bytes_per_element * (m * k + k * n + m * n) / (hbm_bytes_per_s * self.hbm_efficiency)
        return max(compute, memory)

    def attention_efficiency(self, seq_length: int) -> float:
        return self.attn_max * seq_length / (seq_length + self.attn_s0)


# Provisional H200/H100 values, derived from the anchors until bench/gemm.py has run:
# - bf16 8192^3 torch.matmul: 750-792 TFLOP/s = 0.76-0.80 of 989; with this tile model
#   wave_fill = 0.97 and k/(k+128) = 0.985 there, so e_max = 0.80.
# - k0 = 128: two k-tiles of 64 (one pipeline fill plus the epilogue), a typical Hopper
#   kernel's fixed cost per tile; the sweep replaces it with a fitted value.
# - cuDNN causal attention fwd+bwd at B8 H16 S2048 D128: 367 TFLOP/s on the real FLOPs =
#   0.371 of peak; with s0 = 1024 that gives a_max = 0.557 (FA3/cuDNN reach about 0.5-0.6
#   of peak at long sequences).
# - HBM device copy: 4227 GB/s of 4800 = 0.88.
PROVISIONAL = KernelCurves("provisional (anchor GEMM 8192^3, cuDNN SDPA, HBM copy)", 132,
                           0.80, 128.0, 0.557, 1024.0, 0.88)


def fit_curves(measurement: dict, base: KernelCurves = PROVISIONAL) -> KernelCurves:
    """Fit the curve parameters to bench/gemm.py's JSON (least squares on log efficiency).

    The fit keeps the model's shape and only moves its parameters, so the planner stays
    smooth between and beyond the measured shapes.
    """
    peak = measurement["peak_tflops"]
    gemms = [(p["m"], p["n"], p["k"], p["tflops"] / peak) for p in measurement.get("gemm", [])]
    fitted = replace(base, sms=measurement.get("sms", base.sms), source=f"measured: {measurement.get('gpu', '?')}")
    if gemms:
        best = None
        for k0 in (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512):
            shape = [replace(fitted, gemm_max=1.0, gemm_k0=k0).gemm_efficiency(m, n, k) for m, n, k, _ in gemms]
            log_scale = sum(math.log(e / s) for (*_, e), s in zip(gemms, shape)) / len(gemms)
            error = sum((math.log(e / s) - log_scale) ** 2 for (*_, e), s in zip(gemms, shape))
            if best is None or error < best[0]:
                best = (error, k0, math.exp(log_scale))
        fitted = replace(fitted, gemm_k0=float(best[1]), gemm_max=best[2])
    attention = [(p["seq_length"], p["tflops"] / peak) for p in measurement.get("attention", [])]
    if attention:
        best = None
        for s0 in (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096):
            log_scale = sum(math.log(e * (s + s0) / s) for s, e in attention) / len(attention)
            error = sum((math.log(e * (s + s0) / s) - log_scale) ** 2 for s, e in attention)
            if best is None or error < best[0]:
                best = (error, s0, math.exp(log_scale))
        fitted = replace(fitted, attn_s0=float(best[1]), attn_max=best[2])
    dropout = measurement.get("attention_dropout_slowdown")
    if dropout is not None:
        fitted = replace(fitted, attn_dropout_cost=max(0.0, dropout - 1.0))
    if "hbm_gb_per_s" in measurement and "hbm_datasheet_gb_per_s" in measurement:
        fitted = replace(fitted, hbm_efficiency=measurement["hbm_gb_per_s"] / measurement["hbm_datasheet_gb_per_s"])
    return fitted


# FP8 GEMMs (tessera.kernels.fp8, fp8_blockwise) against bf16, measured in one H200 call at
# 8192^3 (torch 2.11), TFLOP/s: bf16 798; torch._scaled_mm
# tensorwise 1509 with fast accumulation (tessera's forward GEMM), 1465 without (its dgrad and
# wgrad, as TE's); F.scaled_mm blockwise 1x128 x 128x128 1314 (split accumulation always). An FP8
# GEMM runs on the bf16 curve's tiles and waves (an assumption: not swept over shapes) at the FP8
# peak, with e_max scaled by its rate's share of the FP8 peak over bf16's share of the bf16 one:
# (forward, backward) factors per --fp8-recipe (delayed scaling runs tensorwise's GEMMs).
_BF16_SHARE = 798 / 989
_TENSORWISE = (1509 / 1979 / _BF16_SHARE, 1465 / 1979 / _BF16_SHARE)
FP8_GEMM_EFFICIENCY = {"tensorwise": _TENSORWISE, "delayed": _TENSORWISE,
                       "blockwise": (1314 / 1979 / _BF16_SHARE,) * 2}


def fp8_curves(curves: KernelCurves, recipe: str) -> tuple[KernelCurves, KernelCurves]:
    """The GEMM curves of FP8 forward and backward (dgrad, wgrad) GEMMs under `recipe`, to be used at the FP8 peak."""
    return tuple(replace(curves, gemm_max=curves.gemm_max * factor, source=f"{curves.source}, FP8 {recipe}")
                 for factor in FP8_GEMM_EFFICIENCY[recipe])


# The H100 SXM is the H200's chip at the same 700 W: equal datasheet rates, but lower
# sustained tensor-core throughput in training (its HBM3 is slower and draws more of the
# power budget). This factor scales the H200 curve's GEMM and attention efficiency for
# an H100. It is tuned to Megatron's published H100 runs (docs/scaling.md): the one free
# scale of the model; the shapes of the curves are not tuned.
H100_SUSTAINED_RATE = 0.83


def load_curves(path: str | Path | None = None, gpu_name: str = "H200") -> KernelCurves:
    """Curves for a GPU: fitted to a bench/gemm.py JSON (`path`, else the committed H200 one),
    else PROVISIONAL.

    An H100 (and an H800, its chip) gets the H200 curve at its sustained rate; an A100 (108 SMs) the Hopper
    efficiencies on its own SM count, a rough guess that `source` admits.
    """
    if path is not None:
        return fit_curves(json.loads(Path(path).read_text()))
    curves = fit_curves(json.loads(MEASURED_CURVE.read_text())) if MEASURED_CURVE.exists() else PROVISIONAL
    if gpu_name.startswith(("H100", "H800")):
        curves = replace(curves, gemm_max=curves.gemm_max * H100_SUSTAINED_RATE,
                         attn_max=curves.attn_max * H100_SUSTAINED_RATE,
                         source=curves.source + f", x{H100_SUSTAINED_RATE} H100 sustained rate")
    elif gpu_name.startswith("A100"):
        curves = replace(curves, sms=108, source=curves.source + ", Hopper efficiencies on 108 SMs (unmeasured)")
    return curves

"""FP8 linears in the step model: their GEMMs at the FP8 rate of the recipe, and the quantisation
passes around them as HBM traffic (tessera.kernels.fp8, tessera.kernels.fp8_blockwise).

What runs in FP8 is what tessera trains in FP8 (tessera.training.fp8): the tensor-parallel
linears of the transformer layers (QKV or MLA's up projections, the attention output, the MLP
or shared expert) and, with --fp8-experts, the routed experts' grouped GEMMs, but for the
layers --first-last-layers-bf16 keeps in bf16. Attention, norms, the embedding and output
layer, the router, MLA's replicated down projections and the MTP depths stay bf16. MFU stays
on the bf16 peak, as Megatron and torchao report FP8 runs.

GEMMs: the FP8 curves of tessera.perf.kernels (measured rates per recipe) at the GPU's FP8 peak,
operands 1 byte each. Quantisation, per linear with input x (tokens x k), weight W (n x k) and
output gradient dy (tokens x n): a scale from an amax reads its tensor once, each cast reads it
again and writes its 1-byte copy, and a transposed copy costs a read and a write of what it
copies. So, in bytes per element (bf16 activations, weights of `w` bytes):

    tensorwise, delayed   forward   x: amax + cast 5; W: 2w + 1
                          backward  dy: amax + cast 5, its FP8 transpose for wgrad 2;
                                    W and x cast again with the forward's scales (w + 1, 3), then
                                    made column-major in FP8 (2 each)
    blockwise             forward   as tensorwise (1x128 tiles of x, 128x128 blocks of W)
                          backward  dy in tiles 5; W^T, dy^T and x^T (the token-direction tiles
                                    of wgrad) each copied transposed in high precision (2w or 4)
                                    and then tiled (2w + 1 or 5)

    experts (any recipe)  forward   x rows: amax + cast 5; W per output column: 2w + 1
                          backward  dy rows 5; W per input column, copied transposed 2w + 1;
                                    for wgrad dy and x per column, copied transposed 5 each
                          and the padding of each expert's rows to 16 (tessera.kernels.fp8_grouped):
                          the rows scattered into a zeroed buffer and gathered back, 10 bytes an
                          element of the input and output forward, 8 backward

With --fp8-param-gather the linears read the weight's E4M3 copy the optimizer gathered (its cast
is counted with the optimizer step): no weight term forward, and backward only the copy's
transpose (2).

Without FP8 wgrad (--no-fp8-wgrad) that GEMM runs at the bf16 rate and its casts are skipped.
Delayed scaling still reads each tensor for its amax (it records it for the next step), so it
moves the bytes tensorwise does. Each pass is counted as its own kernel: where torch.compile
fuses one into a neighbour it costs less, so these terms are an upper estimate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.config import ConfigError
from tessera.perf.kernels import fp8_curves
from tessera.perf.layout import Layout
from tessera.perf.memory import residual_bytes

if TYPE_CHECKING:
    from tessera.perf.simulator import Phase, StepModel


def fp8_peak(steps: "StepModel") -> float:
    """The GPU's dense FP8 peak, FLOP/s."""
    gpu = steps.cluster.gpu
    if "fp8" not in gpu.peak_tflops:
        raise ConfigError(f"--fp8-format needs FP8 tensor cores; the {gpu.name} has none")
    return gpu.peak_tflops["fp8"] * 1e12


def quantisation_bytes(layout: Layout, x: float, weight: float, grad: float) -> tuple[float, float]:
    """HBM bytes of one FP8 linear's quantisation passes (forward, backward) for `x`, `weight` and
    `grad` elements of its input, weight and output gradient."""
    w = residual_bytes(layout)   # the weights' bytes per element
    gathered = layout.fp8_param_gather   # the weight arrives in E4M3
    forward = 5 * x + (0 if gathered else 2 * w + 1) * weight
    wgrad = not layout.no_fp8_wgrad
    if layout.fp8_recipe == "blockwise":
        backward = 5 * grad + (2 if gathered else 4 * w + 1) * weight + wgrad * 9 * (grad + x)
    else:
        backward = 5 * grad + (2 if gathered else w + 3) * weight + wgrad * (2 * grad + 5 * x)
    return forward, backward


def grouped_quantisation_bytes(layout: Layout, x: float, weight: float, grad: float, out: float
                               ) -> tuple[float, float]:
    """HBM bytes (forward, backward) of one FP8 grouped GEMM's casts and row padding, for `x`,
    `weight`, `grad` elements of its input, weights and output gradient, `out` of its output."""
    w = residual_bytes(layout)
    forward = 5 * x + (2 * w + 1) * weight + 10 * (x + out)
    backward = 5 * grad + (2 * w + 1) * weight + (not layout.no_fp8_wgrad) * 5 * (grad + x) + 8 * (x + out)
    return forward, backward


def fp8_gemm(steps: "StepModel", layout: Layout, m: float, n: float, k: float, fwd: "Phase", bwd: "Phase"
             ) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of an FP8 linear with forward shape m x n x k;
    adds its quantisation passes to `fwd` and `bwd`."""
    casts = quantisation_bytes(layout, m * k, n * k, m * n)
    return _timed_with_casts(steps, layout, (m, n, k), 1, layout.fp8_recipe, casts, fwd, bwd)


def fp8_expert_gemm(steps: "StepModel", layout: Layout, m: float, n: float, k: float, groups: int,
                    fwd: "Phase", bwd: "Phase") -> tuple[float, float, float]:
    """The same for the experts' grouped GEMM of `groups` m x n x k shapes, scaled per row (at
    tensorwise's rate), with its casts and row padding."""
    casts = grouped_quantisation_bytes(layout, groups * m * k, groups * n * k, groups * m * n, groups * m * n)
    return _timed_with_casts(steps, layout, (m, n, k), groups, "tensorwise", casts, fwd, bwd)


def _timed_with_casts(steps: "StepModel", layout: Layout, shape: tuple[float, float, float], groups: int,
                      recipe: str, casts: tuple[float, float], fwd: "Phase", bwd: "Phase"
                      ) -> tuple[float, float, float]:
    forward_curves, backward_curves = fp8_curves(steps.curves, recipe)
    peak = fp8_peak(steps)
    forward = steps.gemm(*shape, groups, peak=peak, bytes_per_element=1, curves=forward_curves)[0]
    _, dgrad, wgrad = steps.gemm(*shape, groups, peak=peak, bytes_per_element=1, curves=backward_curves)
    if layout.no_fp8_wgrad:
        wgrad = steps.gemm(*shape, groups)[2]
    fwd.add("fp8_cast", casts[0] / steps.hbm)
    bwd.add("fp8_cast", casts[1] / steps.hbm)
    return forward, dgrad, wgrad

"""Newton–Schulz orthogonalisation: the matrix Muon steps along, and its scale.

`orthogonalize(x)` maps a matrix (or a stack of them, one per MoE expert) to roughly U V^T of
its SVD U S V^T, by a few quintic polynomial iterations on the Frobenius-normalised matrix, run
on its wider orientation so that the Gram matrix is the smaller one. The iteration follows
torch.optim.Muon's `_zeropower_via_newtonschulz` operation for operation, so that
`--muon-coefficient-type simple --muon-fp32-matmul-prec medium` gives its bits; the other
coefficient tables are those Megatron-LM's Muon takes (NVIDIA-NeMo/Emerging-Optimizers,
muon_utils.py): `quintic` cycles five tuned steps (Megatron's default), `polar_express` is
the Polar Express schedule (arXiv 2505.16932), its last step repeated past eight.

--muon-fp32-matmul-prec: `medium` iterates in bf16 (torch.optim.Muon and Megatron's default),
`high` in fp32 with TF32 tensor cores allowed, `highest` in full fp32.
"""

from __future__ import annotations

import contextlib
import math

import torch

from tessera.config.fields import require

COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Keller Jordan's (github.com/KellerJordan/Muon), every step: torch.optim.Muon's defaults.
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Tuned per step (modded-nanogpt), cycled.
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    # Polar Express, arXiv 2505.16932: eight steps, the last repeated beyond.
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
}
PRECISIONS = ("medium", "high", "highest")
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
EPS = 1e-7   # torch.optim.Muon's: the normalisation's floor


def coefficient_schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations (--muon-coefficient-type, --muon-num-ns-steps)."""
    table = COEFFICIENTS[kind]
    if kind == "simple":
        return list(table) * steps
    if kind == "polar_express":
        require(steps >= len(table), f"--muon-coefficient-type polar_express needs --muon-num-ns-steps >= "
                f"{len(table)}, got {steps}")
        return list(table) + [table[-1]] * (steps - len(table))
    require(steps % len(table) == 0, f"--muon-coefficient-type {kind} needs --muon-num-ns-steps a multiple of "
            f"{len(table)}, got {steps}")
    return list(table) * (steps // len(table))


def orthogonalize(x: torch.Tensor, schedule: list[tuple[float, float, float]], precision: str) -> torch.Tensor:
    """The Newton–Schulz iterate of `x` ([rows, cols], or [n, rows, cols]: each matrix on its own),
    in x's dtype."""
    tall = x.size(-2) > x.size(-1)
    work = x.bfloat16() if precision == "medium" else x.float()
    if tall:
        work = work.mT
    norm = work.norm() if work.ndim == 2 else work.norm(dim=(-2, -1), keepdim=True)
    work = work / norm.clamp(min=EPS)
    multiply_add = torch.addmm if work.ndim == 2 else torch.baddbmm
    with _matmul_precision("high" if precision == "high" else "highest"):
        for a, b, c in schedule:
            gram = work @ work.mT
            polynomial = multiply_add(gram, gram, gram, beta=b, alpha=c)
            work = multiply_add(work, polynomial, work, beta=a)
    return (work.mT if tall else work).to(x.dtype)


def update_scale(rows: int, cols: int, mode: str, extra: float = 1.0) -> float:
    """The factor on an orthogonalised [rows, cols] update (--muon-scale-mode, Megatron's names):
    spectral sqrt(max(rows, cols)), with --muon-extra-scale-factor 0.2 Moonlight's match of AdamW's
    update RMS (arXiv 2502.16982; torch.optim.Muon's adjust_lr_fn="match_rms_adamw");
    unit_rms_norm sqrt(rows / cols) (Scion, arXiv 2502.07529); shape_scaling
    sqrt(max(1, rows / cols)) (Keller Jordan's; torch.optim.Muon's default)."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols)) * extra
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols) * extra
    return math.sqrt(max(1, rows / cols)) * extra


@contextlib.contextmanager
def _matmul_precision(precision: str):
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)

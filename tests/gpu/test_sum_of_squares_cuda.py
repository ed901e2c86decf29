"""The one-launch sum of squares (the gradient norm's pass) against fp64 sums, on CUDA.
Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere)."""

import pytest
import torch

from tessera.kernels.sum_of_squares import CHUNK, sum_of_squares, triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")


def test_mixed_dtypes_sizes_and_views_sum_like_fp64():
    generator = torch.Generator("cuda").manual_seed(0)
    # sizes below, at and across chunk boundaries; a strided view; two dtypes
    shapes = [(1,), (CHUNK,), (CHUNK + 1,), (3 * CHUNK - 7,), (257, 129)]
    tensors = [torch.randn(s, device="cuda", generator=generator) * (i + 1) for i, s in enumerate(shapes)]
    tensors = [t.to(torch.bfloat16) if i % 2 else t for i, t in enumerate(tensors)]
    tensors.append(torch.randn(300, 200, device="cuda", generator=generator).t()[::2])
    expected = sum(t.double().square().sum() for t in tensors)
    for _ in range(2):   # the second call reuses the programs' table
        torch.testing.assert_close(sum_of_squares(tensors).double(), expected, rtol=1e-6, atol=0)


def test_a_nan_or_inf_gradient_gives_a_non_finite_sum():
    for bad in (float("nan"), float("inf")):
        tensors = [torch.ones(CHUNK + 5, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        tensors[1][CHUNK + 2] = bad
        assert not torch.isfinite(sum_of_squares(tensors))

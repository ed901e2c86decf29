"""tessera.kernels.pair_sum: the Triton kernel adds each token's k gathered rows exactly as the
torch ops do (fp32 in pair order, one rounding), for widths that are and are not a multiple of
its column block. Run on a GPU machine: `python3 -m pytest tests/gpu -q`."""

import pytest
import torch

from tessera.kernels.pair_sum import sum_pairs, sum_pairs_in_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tokens, k, width, dtype", [(300, 8, 2048, torch.bfloat16), (77, 2, 1500, torch.bfloat16),
                                                     (5, 3, 64, torch.float32)])
def test_the_kernel_sums_as_the_torch_ops_do(tokens, k, width, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(tokens * k, width, device="cuda", generator=generator).to(dtype)
    pairs = torch.randperm(tokens * k, device="cuda", generator=generator).view(tokens, k)
    assert torch.equal(sum_pairs(rows, pairs), sum_pairs_in_torch(rows, pairs))
    assert torch.equal(torch.compile(sum_pairs)(rows, pairs), sum_pairs_in_torch(rows, pairs))

"""tessera.kernels.rope's Triton kernels against the op's torch path (apply_rotary and its
transpose) on the same inputs in fp32: outputs and the QKV gradient, with gradients laid out
as attention's backward gives them ([b, heads, s, d] memory, transposed), on token counts that
do not fill the kernel's tiles. Run on a GPU machine: `python3 -m pytest tests/gpu -q`."""

import pytest
import torch

from tessera.kernels.rope import rotary_qkv
from tessera.models.rope import RotaryEmbedding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = {  # name: (batch, seq, heads, groups, head dim, position ids, dtype)
    "config B's heads, bf16": (2, 300, 16, 4, 128, False, torch.bfloat16),
    "head dim 64, position ids, bf16": (3, 77, 8, 8, 64, True, torch.bfloat16),
    "head dim 96 (tile padded), fp32": (1, 50, 6, 2, 96, False, torch.float32),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_rotary_qkv_kernels_equal_the_torch_path(case):
    batch, seq, heads, groups, d, positions, dtype = case
    generator = torch.Generator().manual_seed(0)
    position_ids = torch.randint(0, 4 * seq, (batch, seq), generator=generator) if positions else None
    cos, sin = RotaryEmbedding(d, 10000.0, 4 * seq)(seq, position_ids)
    qkv = torch.randn(batch, seq, (heads + 2 * groups) * d, generator=generator).to(dtype)
    grads = [torch.randn(batch, n, seq, d, generator=generator).to(dtype).transpose(1, 2)
             for n in (heads, groups, groups)]
    results = []
    for device in ("cuda", "cpu"):   # the kernels, then the torch path in fp32 on the same values
        x = qkv.to(device) if device == "cuda" else qkv.float()
        x.requires_grad_()
        tables = [t.to(device) if device == "cuda" else t.to(dtype).float() for t in (cos, sin)]
        outputs = rotary_qkv(x, *tables, heads, groups)
        torch.autograd.backward(outputs, [g.to(device) if device == "cuda" else g.float() for g in grads])
        results.append([*outputs, x.grad])
    for got, want in zip(*results):
        assert got.dtype == dtype and got.is_contiguous()
        # One rounding to dtype of the same fp32 value (an FMA apart at most).
        torch.testing.assert_close(got.cpu().float(), want.to(dtype).float(), rtol=2**-7 if dtype != torch.float32
                                   else 1e-6, atol=1e-6)

"""Context-parallel attention's CUDA block kernel (FlashAttention's ops with their log-sum-exp)
against the plain-matmul kernel, and every rank's blocks merged against SDPA over the whole
sequence, in bf16. Run on a GPU machine: `python3 -m pytest tests/gpu -q` (skipped elsewhere).

Tolerance, bf16: both sides round their output to bf16 (2^-8 relative); the blocks' merge
is in fp32: relative Frobenius error <= 1e-2 (a first H200 probe of the zigzag ring against fp32
measured 7.9e-3)."""

import pytest
import torch
import torch.nn.functional as F

from tessera.parallel.context import BlockGradients, attend_blocks, block_backward, block_forward
from tessera.parallel.context_split import ZigzagSplit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BATCH, HEADS, GROUPS, SEQ, DIM = 2, 8, 2, 1024, 64


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _qkv():
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(BATCH, n, SEQ, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            for n in (HEADS, GROUPS, GROUPS)]


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_block_kernel_equals_the_plain_one(causal):
    q, k, v = _qkv()
    out, lse = block_forward(q, k, v, causal, DIM ** -0.5, kernel="cuda")
    math_out, math_lse = block_forward(q, k, v, causal, DIM ** -0.5, kernel="math")
    assert _error(out, math_out) < 1e-2 and _error(lse, math_lse) < 1e-4
    dout = torch.randn_like(out)
    for grad, math_grad in zip(block_backward(dout, q, k, v, out, lse, causal, DIM ** -0.5, kernel="cuda"),
                               block_backward(dout, q, k, v, out, lse, causal, DIM ** -0.5, kernel="math")):
        assert _error(grad, math_grad) < 1e-2


@pytest.mark.parametrize("ranks", [2, 4])
def test_zigzag_blocks_equal_sdpa_over_the_whole_sequence(ranks):
    q, k, v = (t.requires_grad_() for t in _qkv())
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    weights = torch.randn_like(expected)
    (expected * weights).sum().backward()
    split = ZigzagSplit.uniform(ranks, SEQ)

    def local(t, rank):
        return split.split(t.detach().transpose(1, 2), rank).transpose(1, 2).contiguous()

    sources = [(s, (local(k, s), local(v, s))) for s in range(ranks)]
    outs, dqs = [], []
    dks, dvs = ([torch.zeros_like(local(t, 0), dtype=torch.float32) for _ in range(ranks)] for t in (k, v))
    for rank in range(ranks):
        out, lse = attend_blocks(local(q, rank), sources, split, rank, DIM ** -0.5, DIM)
        blocks = BlockGradients(local(weights, rank), local(q, rank), out.bfloat16(), lse, split, rank, DIM ** -0.5,
                                torch.zeros_like(local(q, rank), dtype=torch.float32))
        for source, (k_s, v_s) in sources:
            blocks.add(source, k_s, v_s, dks[source], dvs[source])
        outs.append(out)
        dqs.append(blocks.dq)

    def whole(parts):
        return split.unsplit([p.transpose(1, 2) for p in parts]).transpose(1, 2)

    assert _error(whole(outs), expected) < 1e-2
    for parts, t in ((dqs, q), (dks, k), (dvs, v)):
        assert _error(whole(parts), t.grad) < 1e-2

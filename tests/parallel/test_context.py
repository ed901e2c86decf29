"""Context-parallel attention's arithmetic in one process: the log-sum-exp merge of blocks,
every rank's blocks against attention over the whole sequence (forward and backward, GQA,
documents, MLA's narrower values), the plain-matmul kernel against PyTorch's, and the
flags' one-line errors.

Oracles: PyTorch's SDPA over the whole sequence, or a masked softmax in fp64 for packed
documents. Tolerance, fp32 on CPU: the blocks add the same terms in another order and
rescale by exp(lse_i - lse), a few ulps: rtol 1e-5 element-wise, atol 1e-6 for elements
near zero (the same bound as tests/models/test_document_attention.py).
"""

import pytest
import torch
import torch.nn.functional as F

from tessera.parallel.context import BlockGradients, attend_blocks, block_backward, block_forward, merge_partial
from tessera.parallel.context_split import ZigzagSplit
from tests.cli.test_args import error_of
from tests.models.test_document_attention import masked_softmax_attention

SEQ, DIM = 24, 8
DOCUMENTS = [[5, 1, 12, 6], [SEQ], [3, 21]]
close = dict(rtol=1e-5, atol=1e-6)


def qkv(batch=3, heads=4, groups=2, q_dim=DIM, v_dim=DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((heads, q_dim), (groups, q_dim), (groups, v_dim))
    return [torch.randn(batch, n, SEQ, d, generator=g, requires_grad=True) for n, d in shapes]


def test_merged_blocks_equal_one_shot_attention_and_its_log_sum_exp():
    q, k, v = (t.detach() for t in qkv())
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for keys in torch.arange(SEQ).split([7, 1, 10, 6]):   # uneven key blocks
        merge_partial(out, lse, *block_forward(q, k[:, :, keys], v[:, :, keys], False, 0.3))
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True), **close)
    torch.testing.assert_close(lse, scores.logsumexp(-1), **close)


def _local(t: torch.Tensor, split: ZigzagSplit, rank: int) -> torch.Tensor:
    """[b, heads, s, d] -> this rank's [b, heads, s / n, d]."""
    return split.split(t.detach().transpose(1, 2), rank).transpose(1, 2).contiguous()


def _whole(parts, split: ZigzagSplit) -> torch.Tensor:
    return split.unsplit([p.transpose(1, 2) for p in parts]).transpose(1, 2)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["whole samples", "documents"])
@pytest.mark.parametrize("v_dim", [DIM, DIM // 2], ids=["MHA/GQA", "narrower values (MLA)"])
def test_every_rank_s_blocks_equal_attention_over_the_whole_sequence(ranks, packed, v_dim):
    """What a ring (or all-gather) computes, every rank in turn with every rank's keys at hand:
    outputs, and dq, dk, dv summed at their owners, against autograd through the oracle."""
    q, k, v = qkv(v_dim=v_dim)
    if packed:
        split, expected = ZigzagSplit.of_documents(DOCUMENTS, ranks), masked_softmax_attention(
            q, k, v, DOCUMENTS, DIM ** -0.5).float()
    else:
        split, expected = ZigzagSplit.uniform(ranks, SEQ), F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()

    sources = [(s, (_local(k, split, s), _local(v, split, s))) for s in range(ranks)]
    outs, dqs = [], []
    dks, dvs = ([torch.zeros_like(_local(t, split, 0)) for _ in range(ranks)] for t in (k, v))
    for rank in range(ranks):
        q_local = _local(q, split, rank)
        out, lse = attend_blocks(q_local, sources, split, rank, DIM ** -0.5, v_dim)
        blocks = BlockGradients(_local(weights, split, rank), q_local, out, lse, split, rank, DIM ** -0.5,
                                torch.zeros_like(q_local))
        for source, (k_s, v_s) in sources:
            blocks.add(source, k_s, v_s, dks[source], dvs[source])
        outs.append(out)
        dqs.append(blocks.dq)
    torch.testing.assert_close(_whole(outs, split), expected.detach(), **close)
    for name, parts, t in (("dq", dqs, q), ("dk", dks, k), ("dv", dvs, v)):
        torch.testing.assert_close(_whole(parts, split), t.grad, **close, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("causal", [False, True])
def test_plain_matmul_kernel_equals_pytorch_s(causal):
    """The kernel for devices without a fused one (fp32 on a GPU), checked on the CPU kernel."""
    q, k, v = (t.detach() for t in qkv(v_dim=DIM // 2))
    out, lse = block_forward(q, k, v, causal, 0.3, kernel="cpu")
    math_out, math_lse = block_forward(q, k, v, causal, 0.3, kernel="math")
    torch.testing.assert_close(math_out, out, **close)
    torch.testing.assert_close(math_lse, lse, **close)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for name, grad, math_grad in zip("qkv", block_backward(dout, q, k, v, out, lse, causal, 0.3, kernel="cpu"),
                                     block_backward(dout, q, k, v, out, lse, causal, 0.3, kernel="math")):
        torch.testing.assert_close(math_grad, grad, **close, msg=lambda m, name=name: f"d{name}: {m}")


BASE = ["--model", "tiny-llama", "--lr", "1e-3", "--train-iters", "10", "--seq-length", "32"]


@pytest.mark.parametrize("flags, world, expected", [
    (["--context-parallel-size", "3"], 3, "--seq-length (32) must be divisible by 2 x --context-parallel-size (3)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a"], 4,
     "--cp-comm-type a2a: attention heads (4) and KV groups (2) per --tensor-model-parallel-size rank must be "
     "divisible by --context-parallel-size (4)"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], 4,
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"], 4,
     "--hierarchical-context-parallel-sizes (2 3) must be two positive sizes whose product is "
     "--context-parallel-size (4)"),
    (["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a", "p2p"], 2,
     "--cp-comm-type: give one value or one per layer (--num-layers 2), got 3"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2, "--attention-dropout > 0 with"),
    (["--context-parallel-size", "2", "--attention-dropout", "0", "--hidden-dropout", "0.1"], 2,
     "--hidden-dropout > 0 with"),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "36"], 8, "--seq-length (36) / --context-parallel-size (2) must be divisible by "
                                 "--tensor-model-parallel-size (4) under --sequence-parallel"),
])
def test_bad_context_parallel_flags_name_the_flags(capsys, flags, world, expected):
    assert expected in error_of(capsys, BASE + flags, world_size=world)


def test_megatron_s_allgather_spelling_is_all_gather():
    from tessera.cli.args import parse_run_config

    config, _ = parse_run_config(BASE + ["--context-parallel-size", "2", "--cp-comm-type", "allgather", "p2p"],
                                 world_size=2)
    assert config.parallel.cp_comm_type == ["all_gather", "p2p"]

"""The zigzag split of samples for context parallelism: a permutation, undone exactly by
`unsplit`, rank r holding chunks r and 2n-1-r, documents cut one by one with every rank
holding the same number of tokens, balanced causal work, and the orders the all-to-alls use.

Everything here is index arithmetic: comparisons are exact.
"""

import pytest
import torch

from tessera.models.rope import RotaryEmbedding
from tessera.parallel.context_split import SplitDocuments, ZigzagSplit

SEQ = 24
DOCUMENTS = [[5, 1, 12, 6], [SEQ], [3, 21]]   # short and one-token documents, one whole sample, two


def splits(ranks: int):
    return {"whole samples": ZigzagSplit.uniform(ranks, SEQ), "documents": ZigzagSplit.of_documents(DOCUMENTS, ranks)}


def sample_tensors(batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, 256, (batch, SEQ), generator=g),
            "labels": torch.randint(0, 256, (batch, SEQ), generator=g),
            "loss_mask": (torch.rand(batch, SEQ, generator=g) > 0.3).float(),
            "position_ids": torch.randint(0, 64, (batch, SEQ), generator=g)}


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["whole samples", "documents"])
def test_split_is_a_permutation_and_unsplit_undoes_it(ranks, kind):
    split = splits(ranks)[kind]
    rows = split.positions(0).shape[0]
    held = torch.cat([split.positions(rank) for rank in range(ranks)], dim=1).sort(dim=1).values
    assert torch.equal(held, torch.arange(SEQ).expand(rows, -1))   # every token on exactly one rank
    rotary = RotaryEmbedding(8, 10000.0, 64)
    for name, tensor in sample_tensors(len(DOCUMENTS)).items():
        parts = [split.split(tensor, rank) for rank in range(ranks)]
        assert all(part.shape == (len(DOCUMENTS), SEQ // ranks) for part in parts), name
        assert torch.equal(split.unsplit(parts), tensor), name
        if name == "position_ids":   # RoPE angles of the split positions are the split angles
            cos, sin = rotary(SEQ, tensor)
            for rank, part in enumerate(parts):
                local_cos, local_sin = rotary(SEQ // ranks, part)
                assert torch.equal(local_cos, split.split(cos, rank))
                assert torch.equal(local_sin, split.split(sin, rank))


@pytest.mark.parametrize("ranks", [2, 4])
def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r(ranks):
    chunks = torch.arange(SEQ).view(2 * ranks, -1)
    for rank in range(ranks):
        expected = torch.cat([chunks[rank], chunks[2 * ranks - 1 - rank]])
        assert torch.equal(ZigzagSplit.uniform(ranks, SEQ).positions(rank)[0], expected)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_each_document_is_cut_in_near_equal_chunks_and_ranks_hold_equal_shares(ranks):
    split = ZigzagSplit.of_documents(DOCUMENTS, ranks)
    for lengths, documents in zip(DOCUMENTS, split.rows):
        assert [sum(chunks) for chunks in documents] == lengths
        for length, chunks in zip(lengths, documents):
            assert set(chunks) <= {length // (2 * ranks), length // (2 * ranks) + 1}
    # rank r's tokens of each document are that document's chunks r and 2n-1-r, in order
    for rank in range(ranks):
        for row, documents in enumerate(split.rows):
            start, expected = 0, []
            for chunks in documents:
                bounds = [start + sum(chunks[:j]) for j in range(2 * ranks + 1)]
                for j in (rank, 2 * ranks - 1 - rank):
                    expected += range(bounds[j], bounds[j + 1])
                start += sum(chunks)
            assert split.positions(rank)[row].tolist() == expected


def test_split_documents_count_the_whole_documents_squares():
    split = ZigzagSplit.of_cu_seqlens([0, 5, 6, 18, 24, 48, 51, 72], SEQ, 2)
    assert split == ZigzagSplit.of_documents(DOCUMENTS, 2)
    assert SplitDocuments(split).squared_lengths == sum(n * n for row in DOCUMENTS for n in row)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_causal_work_is_balanced_over_ranks_and_steps(ranks):
    """Every (rank, source) pair but the diagonal computes 2c^2 scores (c = SEQ / 2n); the
    diagonal 2c^2 + c, its causal half with the diagonal: the same for every rank."""
    split, c = ZigzagSplit.uniform(ranks, SEQ), SEQ // (2 * ranks)

    def work(rank: int, source: int) -> int:
        return sum(p.q_len * (p.q_len + 1) // 2 if p.causal else p.q_len * p.kv_len
                   for p in split.pieces(rank, source))

    for rank in range(ranks):
        assert work(rank, rank) == 2 * c * c + c
        assert all(work(rank, source) == 2 * c * c for source in range(ranks) if source != rank)


@pytest.mark.parametrize("ranks, group", [(2, 2), (4, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("kind", ["whole samples", "documents"])
def test_gather_order_puts_a_group_s_tokens_in_the_coarser_split_s_order(ranks, group, kind):
    split = splits(ranks)[kind]
    coarse = split.coarsen(group)
    for outer in range(ranks // group):
        collected = torch.cat([split.positions(outer * group + i) for i in range(group)], dim=1)
        reordered = collected.gather(1, split.gather_order(outer, group))
        assert torch.equal(reordered, coarse.positions(outer))
    if group == ranks:   # one group: the whole sample, in sequence order
        assert torch.equal(coarse.positions(0), torch.arange(SEQ).expand_as(coarse.positions(0)))


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="divisible by 2 x 4"):
        ZigzagSplit.uniform(4, 20)
    with pytest.raises(ValueError, match="must all be that long"):
        ZigzagSplit.of_documents([[10, 14], [20]], 2)

"""Packing conversations into rows: first-fit-decreasing, documents, shifted labels and masks,
truncation, context-parallel padding."""

import numpy as np
import pytest
import torch

from tessera.parallel.context_split import ZigzagSplit
from tessera.posttrain.sft_packing import first_fit_decreasing, pack_row

PAD = 999


def textbook_ffd(sizes: list[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing as textbooks write it: longest first, each into the first row with room."""
    rows, free = [], []
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):   # a stable sort: ties in index order
        for row, room in enumerate(free):
            if room >= sizes[item]:
                rows[row].append(item)
                free[row] -= sizes[item]
                break
        else:
            rows.append([item])
            free.append(capacity - sizes[item])
    return rows


@pytest.mark.parametrize("count, capacity", [(1, 5), (7, 9), (200, 33), (300, 1000)])
def test_first_fit_decreasing_is_the_textbook_packing(count, capacity):
    rng = np.random.default_rng(count)
    for _ in range(5):
        sizes = rng.integers(1, capacity + 1, count)
        row_starts, items = first_fit_decreasing(sizes, capacity)
        rows = [items[a:b].tolist() for a, b in zip(row_starts, row_starts[1:])]
        assert rows == textbook_ffd(sizes.tolist(), capacity)


def conversation(first_id: int, length: int, answer_from: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids; the mask is 1 from `answer_from` on (a prompt, then the answer)."""
    mask = np.zeros(length, dtype=np.uint8)
    mask[answer_from:] = 1
    return np.arange(first_id, first_id + length), mask


def alone(ids: np.ndarray, mask: np.ndarray) -> tuple[list[int], list[int], list[float]]:
    """A conversation as its own sample: inputs, labels and loss mask of its len - 1 predictions."""
    return ids[:-1].tolist(), ids[1:].tolist(), mask[1:].astype(float).tolist()


def test_a_row_is_its_conversations_as_documents_each_as_if_alone():
    a, b = conversation(10, 5, 2), conversation(20, 3, 1)
    sample = pack_row([a, b], seq_length=12, pad=PAD)
    assert sample["cu_seqlens"].tolist() == [0, 5, 8, 12]
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
    assert sample["tokens"].dtype == sample["labels"].dtype == sample["position_ids"].dtype == torch.int64
    assert sample["loss_mask"].dtype == torch.float32 and sample["cu_seqlens"].dtype == torch.int32
    for (ids, mask), start in zip((a, b), (0, 5)):
        inputs, labels, loss_mask = alone(ids, mask)
        end = start + len(ids) - 1
        assert sample["tokens"][start:end].tolist() == inputs and sample["labels"][start:end].tolist() == labels
        assert sample["loss_mask"][start:end].tolist() == loss_mask
        assert sample["loss_mask"][end] == 0   # its last token's label is the next document's first
    assert sample["tokens"][8:].tolist() == [PAD] * 4 and not sample["loss_mask"][7:].any()


def test_an_answer_that_opens_a_conversation_is_not_learnt_from_the_one_before():
    first, second = conversation(10, 4, 0), conversation(20, 4, 0)   # every token an answer token
    sample = pack_row([first, second], seq_length=8, pad=PAD)
    assert sample["labels"][3] == 20 and sample["loss_mask"][3] == 0
    assert sample["loss_mask"].tolist() == [1, 1, 1, 0, 1, 1, 1, 0]


def test_a_full_row_ends_on_a_label_of_its_last_conversation():
    a, b = conversation(10, 6, 3), conversation(20, 7, 1)   # 13 tokens: seq_length 12 + 1
    sample = pack_row([a, b], seq_length=12, pad=PAD)
    assert sample["cu_seqlens"].tolist() == [0, 6, 12]
    assert sample["labels"][-1] == 26 and sample["loss_mask"][-1] == 1
    assert PAD not in sample["tokens"].tolist() + sample["labels"].tolist()


def test_a_conversation_longer_than_a_row_is_cut_on_the_right_with_no_end_of_turn_added():
    ids, mask = conversation(100, 30, 4)
    sample = pack_row([(ids, mask)], seq_length=12, pad=PAD)
    assert sample["tokens"].tolist() == ids[:12].tolist() and sample["labels"].tolist() == ids[1:13].tolist()
    assert sample["loss_mask"].tolist() == mask[1:13].tolist()
    assert sample["cu_seqlens"].tolist() == [0, 12] and sample["position_ids"].tolist() == list(range(12))


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_splits_rows_of_conversations_of_any_length(cp):
    """No padding for CP: the zigzag split cuts each conversation, whatever its length, and every
    rank holds seq_length / CP tokens (so a row, and a run, is the same for any CP)."""
    seq_length = 16 * cp
    rng = np.random.default_rng(cp)
    conversations = [conversation(100 * i, int(n), 1) for i, n in enumerate(rng.integers(3, 4 * cp, 3))]
    sample = pack_row(conversations, seq_length, pad=PAD)
    bounds = sample["cu_seqlens"].tolist()
    assert any((b - a) % (2 * cp) for a, b in zip(bounds, bounds[1:]))   # lengths 2 x CP does not divide
    split = ZigzagSplit.of_cu_seqlens(bounds, seq_length, cp)
    pieces = [split.split(sample["tokens"][None], rank)[0] for rank in range(cp)]
    assert all(len(piece) == seq_length // cp for piece in pieces)
    assert sorted(torch.cat(pieces).tolist()) == sorted(sample["tokens"].tolist())

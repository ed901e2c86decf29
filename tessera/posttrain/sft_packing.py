"""Conversations packed into training rows: first-fit-decreasing, truncation.

A row has seq_length + 1 token slots: the inputs are slots [0, s) and the labels slots
[1, s + 1), as in pretraining (tessera.data.gpt_dataset). Each conversation is one
document of the row (its own `cu_seqlens` entry, position ids from 0), so no token
attends to another conversation (tessera.models.documents). A label is trained only if
its token is an assistant token of the same conversation: the prediction made at a
conversation's last token (of the next conversation's first) and every padding slot
have loss mask 0.

- Packing: first-fit-decreasing on the conversations' lengths (each into the first row
  with room, longest first), which depends on the lengths alone: not on the seed, nor on
  the number of data-parallel ranks. What a row leaves free at its end is padding, a
  document of its own, never trained.
- Context parallelism needs no padding: its zigzag split cuts each document into 2 x CP
  chunks of any length (tessera.parallel.context_split), so a row is the same whatever the
  number of context-parallel ranks, and so is what a run computes.
- Truncation: a conversation longer than a row is cut on the right to fill a row alone
  (as Megatron-LM truncates). Its remaining assistant tokens are trained; the turn that
  was cut gets no end-of-turn (none is appended), and the row's last label is one of the
  conversation's own tokens. A cut that leaves no assistant token to learn drops the
  conversation (tessera.posttrain.sft_dataset counts both, once).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def row_sizes(lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """Slots each conversation takes in a row of seq_length + 1: its length, at most a row."""
    return np.minimum(np.asarray(lengths, dtype=np.int64), seq_length + 1)


def first_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bins of `capacity` for items of `sizes` (each <= capacity), first-fit-decreasing.

    Returns (row_starts [rows + 1], items): row r holds items[row_starts[r]:row_starts[r + 1]],
    in the order they were placed. Ties in size go in index order. A segment tree of the
    rows' free room finds each item's first fitting row in O(log n).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) and (sizes.max() > capacity or sizes.min() < 1):
        raise ValueError(f"item sizes must be in [1, {capacity}]")
    order = np.argsort(-sizes, kind="stable")
    leaves = 1 << max(len(sizes) - 1, 0).bit_length()
    free = [capacity] * (2 * leaves)   # node: the most free room of a row below it (unused rows: all)
    row_of = np.empty(len(sizes), dtype=np.int64)
    size_of = sizes.tolist()
    for item in order.tolist():
        size, node = size_of[item], 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= size else 2 * node + 1
        row_of[item] = node - leaves
        free[node] -= size
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    items = order[np.argsort(row_of[order], kind="stable")]
    rows = int(row_of.max()) + 1 if len(sizes) else 0
    row_starts = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))]).astype(np.int64)
    return row_starts, items


def trained_after_truncation(mask: np.ndarray, seq_length: int) -> int:
    """How many labels of a conversation cut to a row are trained (its first token is no label)."""
    return int(np.count_nonzero(mask[1:seq_length + 1]))


def pack_row(conversations: Sequence[tuple[np.ndarray, np.ndarray]], seq_length: int,
             pad: int) -> dict[str, torch.Tensor]:
    """One training sample from the (token ids, loss mask) of the conversations of a row:
    tokens, labels, loss_mask, position_ids [seq_length] and cu_seqlens (int32, 0 ... s)."""
    slots = seq_length + 1
    tokens = np.full(slots, pad, dtype=np.int64)
    trained = np.zeros(slots, dtype=bool)
    positions = np.empty(slots, dtype=np.int64)
    ends, at = [], 0
    for ids, mask in conversations:
        length = min(len(ids), slots)
        if at + length > slots:
            raise ValueError(f"conversations of {at + length} slots overflow a row of {slots}")
        tokens[at:at + length] = ids[:length]
        trained[at:at + length] = mask[:length] != 0
        positions[at:at + length] = np.arange(length)
        at += length
        ends.append(at)
    positions[at:] = np.arange(slots - at)   # the padding at the end: a document of its own
    loss_mask = trained[1:].copy()
    inner_ends = [end for end in ends if end <= seq_length]
    loss_mask[[end - 1 for end in inner_ends]] = False   # a last token's label starts the next document
    boundaries = [0] + [end for end in inner_ends if end < seq_length] + [seq_length]
    return {"tokens": torch.from_numpy(tokens[:-1]), "labels": torch.from_numpy(tokens[1:]),
            "loss_mask": torch.from_numpy(loss_mask.astype(np.float32)),
            "position_ids": torch.from_numpy(positions[:-1]),
            "cu_seqlens": torch.tensor(boundaries, dtype=torch.int32)}

"""Context parallelism's cut of each sample: 2 x CP chunks, rank r holding chunks r and 2 CP - 1 - r.

Causal attention's work grows along the sequence; a rank holding one early and one late
chunk does as much as every other ("zigzag", Megatron's DualChunkSwap, torch's head-tail
load balancer). A rank's local sequence is its two chunks side by side, and every tensor
along the sequence (tokens, labels, loss mask, position ids, so the RoPE angles too) is
cut the same way once, before the model (`split`); `unsplit` is the inverse.

Packed documents are cut one by one, each into 2 x CP chunks of its own, so that every
document keeps the balance (Megatron's THD split). A document's length need not divide
by 2 x CP: its chunks take floor(n / 2CP) tokens and the remainder goes one token at a
time to the ranks in turn, the turn carried from document to document across the
sample, so every rank holds exactly seq_length / CP tokens. Nothing is padded: every
rank's tensors keep the same static shape with or without documents (pipeline
activations, sequence parallelism, the all-to-all), and chunks may be empty.

Which pieces of a rank's queries see which pieces of another rank's keys follows from the
order of the chunks, without masks (`pieces`, the step table of TE's ring attention):

    keys of the same rank     both query chunks, both key chunks, causal
    keys of a rank s < r      both query chunks against key chunk s alone (chunk 2CP-1-s is later)
    keys of a rank s > r      query chunk 2CP-1-r alone against both key chunks (chunk r sees neither)

`coarsen` describes the sequence that an all-to-all over groups of `g` neighbouring ranks
collects: their chunks together are chunks o and 2(CP/g) - 1 - o of the coarser cut for
CP/g ranks (hierarchical a2a+p2p; with g = CP the whole sequence, for a2a).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch


class Piece(NamedTuple):
    """One block of attention: queries [q_start, q_start + q_len) of a rank's local sequence
    against keys [kv_start, kv_start + kv_len) of another's, in sample `row` (None: every row)."""

    row: int | None
    q_start: int
    q_len: int
    kv_start: int
    kv_len: int
    causal: bool


@dataclass(frozen=True)
class ZigzagSplit:
    """How the tokens of each sample are dealt to `ranks` ranks."""

    ranks: int
    seq_length: int
    # per sample row, per document in order: its 2 x ranks chunk lengths. `shared`: one row
    # that every sample of the batch follows (no packed documents).
    rows: tuple[tuple[tuple[int, ...], ...], ...]
    shared: bool = True

    @classmethod
    @functools.lru_cache(maxsize=32)   # built from the shapes by every layer: once
    def uniform(cls, ranks: int, seq_length: int) -> "ZigzagSplit":
        """The split of whole samples (no packed documents)."""
        if seq_length % (2 * ranks):
            raise ValueError(f"sequence length {seq_length} must be divisible by 2 x {ranks} context-parallel ranks")
        return cls(ranks, seq_length, (((seq_length // (2 * ranks),) * 2 * ranks,),))

    @classmethod
    def of_documents(cls, lengths_per_row: Sequence[Sequence[int]], ranks: int) -> "ZigzagSplit":
        """The split of packed samples, each document cut on its own; `lengths_per_row`: the
        documents' lengths, sample by sample."""
        seq_length = sum(lengths_per_row[0])
        if seq_length % (2 * ranks) or any(sum(row) != seq_length for row in lengths_per_row):
            raise ValueError(f"packed samples of {seq_length} tokens must all be that long and divisible by "
                             f"2 x {ranks} context-parallel ranks")
        return cls(ranks, seq_length, tuple(_cut_documents(row, ranks) for row in lengths_per_row), shared=False)

    @classmethod
    def of_cu_seqlens(cls, cu_seqlens: Sequence[int], seq_length: int, ranks: int) -> "ZigzagSplit":
        """From THD boundaries over batch x seq_length tokens (every sample boundary is one)."""
        rows: list[list[int]] = []
        for start, end in zip(cu_seqlens, cu_seqlens[1:]):
            if start % seq_length == 0:
                rows.append([])
            rows[-1].append(end - start)
        return cls.of_documents(rows, ranks)

    @property
    def local_length(self) -> int:
        return self.seq_length // self.ranks

    # -- where each rank's tokens lie -------------------------------------------------

    @functools.cached_property
    def _layout(self) -> tuple:
        """[rank][row][document] -> (local start, length of chunk r, length of chunk 2n-1-r,
        sample position of chunk r, sample position of chunk 2n-1-r)."""
        n = self.ranks
        layout = []
        for rank in range(n):
            rank_rows = []
            for documents in self.rows:
                entries, local, begin = [], 0, 0
                for chunks in documents:
                    starts = [begin + sum(chunks[:j]) for j in (rank, 2 * n - 1 - rank)]
                    low, high = chunks[rank], chunks[2 * n - 1 - rank]
                    entries.append((local, low, high, *starts))
                    local += low + high
                    begin += sum(chunks)
                rank_rows.append(tuple(entries))
            layout.append(tuple(rank_rows))
        return tuple(layout)

    def positions(self, rank: int) -> torch.Tensor:
        """Sample positions of `rank`'s local tokens, in local order: int64 [rows, local_length]
        (one row when `shared`)."""
        return self._memo(("positions", rank), lambda: torch.stack([
            torch.cat([torch.arange(start, start + length) for _, low, high, low_at, high_at in entries
                       for start, length in ((low_at, low), (high_at, high))])
            for entries in self._layout[rank]]))

    def _memo(self, key, compute):
        """What `compute` returns, computed once per split (a split lives for one micro-batch)."""
        memo = self.__dict__.setdefault("_memo_", {})
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def split(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s part of a [batch, seq_length, ...] tensor: [batch, local_length, ...]."""
        positions = self.positions(rank).to(tensor.device)
        if self.shared:
            return tensor[:, positions[0]]
        return tensor[torch.arange(tensor.shape[0], device=tensor.device)[:, None], positions]

    def unsplit(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The inverse of `split`: the whole [batch, seq_length, ...] tensor from every rank's part."""
        first = parts[0]
        whole = first.new_empty((first.shape[0], self.seq_length, *first.shape[2:]))
        batch = torch.arange(first.shape[0], device=first.device)[:, None]
        for rank, part in enumerate(parts):
            positions = self.positions(rank).to(first.device)
            whole[batch, positions.expand(first.shape[0], -1)] = part
        return whole

    # -- which queries see which keys -------------------------------------------------

    def pieces(self, q_rank: int, kv_rank: int) -> tuple[Piece, ...]:
        """The attention blocks of `q_rank`'s queries against `kv_rank`'s keys, document by
        document (the table in the module docstring); empty blocks are left out."""
        return self._memo(("pieces", q_rank, kv_rank), lambda: self._pieces(q_rank, kv_rank))

    def _pieces(self, q_rank: int, kv_rank: int) -> tuple[Piece, ...]:
        pieces = []
        for row, (q_entries, kv_entries) in enumerate(zip(self._layout[q_rank], self._layout[kv_rank])):
            for (q_at, q_low, q_high, *_), (kv_at, kv_low, kv_high, *_) in zip(q_entries, kv_entries):
                if kv_rank == q_rank:
                    block = (q_at, q_low + q_high, kv_at, kv_low + kv_high, True)
                elif kv_rank < q_rank:
                    block = (q_at, q_low + q_high, kv_at, kv_low, False)
                else:
                    block = (q_at + q_low, q_high, kv_at, kv_low + kv_high, False)
                if block[1] and block[3]:
                    pieces.append(Piece(None if self.shared else row, *block))
        return tuple(pieces)

    # -- the sequence an all-to-all collects ------------------------------------------

    def coarsen(self, group: int) -> "ZigzagSplit":
        """The split for ranks // group ranks whose chunk j is this split's chunks
        [j x group, (j + 1) x group) together."""
        if self.ranks % group:
            raise ValueError(f"{group} ranks per group must divide {self.ranks} context-parallel ranks")
        def coarser() -> ZigzagSplit:
            rows = tuple(tuple(tuple(sum(chunks[j:j + group]) for j in range(0, len(chunks), group))
                               for chunks in documents) for documents in self.rows)
            return ZigzagSplit(self.ranks // group, self.seq_length, rows, self.shared)

        return self._memo(("coarsen", group), coarser)

    def gather_order(self, outer_rank: int, group: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Indices that put the local tokens of ranks outer_rank x group ... + group - 1, laid
        side by side in rank order (what an all-to-all over them collects), into the local
        order of `outer_rank` in `coarsen(group)`; int64 [rows, group x local_length] on `device`
        (copied there once per split, not by every layer)."""
        return self._memo(("gather_order", outer_rank, group, str(device)),
                          lambda: self._gather_order(outer_rank, group).to(device))

    def _gather_order(self, outer_rank: int, group: int) -> torch.Tensor:
        members = [self.positions(outer_rank * group + i) for i in range(group)]
        collected = torch.cat(members, dim=1)                      # sample position of each collected token
        wanted = self.coarsen(group).positions(outer_rank)
        # per row, the index in `collected` of each wanted position (both hold the same positions)
        sorted_positions, sorted_index = collected.sort(dim=1)
        return sorted_index.gather(1, torch.searchsorted(sorted_positions, wanted))


@dataclass(eq=False)
class SplitDocuments:
    """A micro-batch's packed documents under context parallelism, in place of its Documents:
    how its samples are split, and the whole samples' Documents (tessera.models.documents),
    over which a2a layers attend (None when no layer does)."""

    split: ZigzagSplit
    whole: object | None = None

    @property
    def squared_lengths(self) -> int:
        """Sum of the squared document lengths of the whole samples (the FLOPs count's)."""
        return sum(sum(chunks) ** 2 for documents in self.split.rows for chunks in documents)


def _cut_documents(lengths: Sequence[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Each document's 2 x ranks chunk lengths: floor(n / 2 ranks) each, the remainder one token
    at a time to the ranks in turn (a rank's first extra token to its early chunk, a second to
    its late one), the turn carried on from document to document."""
    turn, documents = 0, []
    for length in lengths:
        chunks = [length // (2 * ranks)] * (2 * ranks)
        taken = [0] * ranks
        for _ in range(length % (2 * ranks)):
            rank = turn % ranks
            chunks[rank if taken[rank] == 0 else 2 * ranks - 1 - rank] += 1
            taken[rank] += 1
            turn += 1
        documents.append(tuple(chunks))
    return tuple(documents)

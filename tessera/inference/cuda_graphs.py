"""CUDA graphs of the decode step: one kernel launch sequence replayed per token.

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python
they take longer than the GPU needs to read the weights. So the step (compiled by
torch.compile where asked, which fuses the norms, RoPE and activations) is captured once
per padded shape and replayed: rows are padded to a bucket (1, 2, 4, 8, then multiples of
8) and block tables to a power of two of blocks, so a context of C tokens gathers at most
2C keys. Graphs are captured on first use and share one memory pool.

Inputs live in static device buffers (token ids, positions, block tables) that each step
fills with one host-to-device copy each; slots and context lengths are computed on the
device inside the graph. Padded rows decode token 0 at position 0 into block 0, the block
the allocator never hands out. Nothing in the step reads the device from the host, so
the step costs the host only the copies and the replay.

Greedy runs (`greedy_steps`): a second graph per shape ends with the argmax written back into
the token-id buffer and the positions advanced, so several decode steps replay back to
back with no host work between them and their tokens are read once at the end. Without
that, the host's scheduling and sampling between two steps left the GPU idle for ~20% of
a batch-1 step and ~25% of a batch-32 one (config B on an H200).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def row_bucket(rows: int) -> int:
    """The padded batch size: 1, 2, 4, 8, then the next multiple of 8."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


def block_bucket(blocks: int) -> int:
    return 1 << (blocks - 1).bit_length()


class DecodeGraphs:
    """`forward(ids [rows], positions [rows], block tables [rows, blocks]) -> logits [rows, vocab]`,
    replayed from CUDA graphs."""

    def __init__(self, forward: Forward, *, max_rows: int, max_blocks: int, device: torch.device,
                 vocab_size: int, max_steps: int = 1, compile: bool = True):
        self.forward = torch.compile(forward) if compile else forward
        self.vocab_size = vocab_size
        self.compiled = compile
        self.max_rows, self.max_blocks = row_bucket(max_rows), block_bucket(max_blocks)
        buffers = dict(ids=(self.max_rows,), positions=(self.max_rows,), tables=(self.max_rows, self.max_blocks))
        self.device_inputs = {name: torch.zeros(shape, dtype=torch.int64, device=device)
                              for name, shape in buffers.items()}
        self.host_inputs = {name: torch.zeros(shape, dtype=torch.int64, pin_memory=True)
                            for name, shape in buffers.items()}
        self.tokens = torch.zeros(max_steps, self.max_rows, dtype=torch.int64, device=device)   # greedy_steps' out
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def __call__(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
                 ) -> torch.Tensor:
        graph, logits = self._graph(ids, tables, greedy=False)
        self._fill(ids, positions, tables)
        graph.replay()
        return logits[:len(ids)]

    def greedy_steps(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
                     steps: int) -> list[list[int]]:
        """`steps` greedy decode steps from tokens `ids` at `positions` (the tables covering
        positions + steps): each row's `steps` next tokens, with one read of the device."""
        if not 1 <= steps <= self.tokens.shape[0]:
            raise ValueError(f"steps must be in 1..{self.tokens.shape[0]}, got {steps}")
        graph, _ = self._graph(ids, tables, greedy=True)
        self._fill(ids, positions, tables)
        rows = row_bucket(len(ids))
        for step in range(steps):
            graph.replay()
            self.tokens[step, :rows].copy_(self.device_inputs["ids"][:rows])
        return self.tokens[:steps, :len(ids)].T.tolist()

    def _graph(self, ids: Sequence[int], tables: Sequence[Sequence[int]], greedy: bool
               ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        rows = row_bucket(len(ids))
        blocks = min(block_bucket(max(len(t) for t in tables)), self.max_blocks)
        return self.graphs.get((rows, blocks, greedy)) or self._capture(rows, blocks, greedy)

    def _fill(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        rows = row_bucket(len(ids))
        host = {name: tensor.numpy() for name, tensor in self.host_inputs.items()}
        host["ids"][:rows] = 0
        host["positions"][:rows] = 0
        host["tables"][:rows] = 0
        host["ids"][:len(ids)] = ids
        host["positions"][:len(ids)] = positions
        for row, table in enumerate(tables):
            host["tables"][row, :len(table)] = table
        for name, tensor in self.device_inputs.items():
            tensor[:rows].copy_(self.host_inputs[name][:rows], non_blocking=True)

    def _inputs(self, rows: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.device_inputs
        return d["ids"][:rows], d["positions"][:rows], d["tables"][:rows, :blocks]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, greedy: bool) -> torch.Tensor:
        logits = self.forward(ids, positions, tables)
        if greedy:   # the next step's inputs
            ids.copy_(logits[:, :self.vocab_size].argmax(dim=-1))
            positions.add_(1)
        return logits

    def _capture(self, rows: int, blocks: int, greedy: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = self._inputs(rows, blocks)
        for tensor in inputs:   # padding: every write goes to block 0
            tensor.zero_()
        if self.compiled:   # one compiled graph for all buckets (sizes 1 are specialised by torch.compile)
            for tensor in inputs:
                for dim, size in enumerate(tensor.shape):
                    if size > 1:
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up (and compilation) outside the capture
            for _ in range(2):
                self._step(*inputs, greedy)
        torch.cuda.current_stream().wait_stream(side)
        for tensor in inputs:   # the warm-up's greedy steps moved the positions on
            tensor.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(*inputs, greedy)
        self._pool = graph.pool()
        self.graphs[(rows, blocks, greedy)] = graph, logits
        return graph, logits

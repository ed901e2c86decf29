"""CUDA graphs of engine steps: the decode step replayed per token, steps of prompts per padded size.

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python
they take longer than the GPU needs to read the weights. So the step (compiled by
torch.compile where asked, which fuses the norms, RoPE and activations) is captured once
per padded shape and replayed: rows are padded to a bucket (1, 2, 4, 8, then multiples of
8) and block tables to a power of two of blocks, so a context of C tokens gathers at most
2C keys. Graphs are captured on first use and share one memory pool.

Inputs live in static device buffers (token ids, positions, block tables, and for models
with recurrent layers each row's state slot) that each step fills with one host-to-device
copy each; slots and context lengths are computed on the device inside the graph. Padded
rows decode token 0 at position 0 into block 0, the block the allocator never hands out
(and state slot 0, which the scheduler never hands out). Nothing in the step reads the
device from the host, so the step costs the host only the copies and the replay.

Greedy runs (`start_greedy`): a second graph per shape ends with the argmax written back into
the token-id buffer and the positions advanced, so several decode steps replay back to
back with no host work between them and their tokens are read once at the end. Without
that, the host's scheduling and sampling between two steps left the GPU idle for ~20% of
a batch-1 step and ~25% of a batch-32 one (config B on an H200). A run returns before its
steps end (`GreedyRun`), and `continue_greedy` queues the next run of the same rows from the
tokens and positions the last one left on the device: the engine queues it before it reads
the first, so that the GPU does not wait for the host between runs either (~1.5% of a
batch-1 step).

Steps of fresh prompts alone (`PromptGraphs`): eagerly, a prompt's step is ~700 kernel
launches, ~30 ms of host time for config B where the GPU needs ~2 ms. Their tokens are padded
to a `token_bucket` and their documents to a row bucket (`padded_prompts`): the padding tokens
form documents of their own (FlashAttention's variable-length kernel then needs no mask),
write their keys into the null block and their logits are dropped. Only with that kernel
(bf16 and fp16 on CUDA), whose inputs are all device tensors.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Sequence

import torch

from tessera.inference.paged_attention import StepAttention
from tessera.kernels.argmax import argmax_into
from tessera.models.documents import Documents

POLL_SECONDS = 50e-6   # GreedyRun.tokens' sleep between looks at the device

Forward = Callable[..., torch.Tensor]   # (ids, positions, tables[, state slots]) -> logits
PromptForward = Callable[[torch.Tensor, torch.Tensor, StepAttention, torch.Tensor], torch.Tensor]


@dataclasses.dataclass
class GreedyRun:
    """Greedy decode steps queued on the device; `tokens()` waits for them."""

    rows: int
    steps: int
    host_tokens: torch.Tensor               # [steps, rows], complete once `done` has fired
    done: torch.cuda.Event | None = None

    def tokens(self) -> list[list[int]]:
        """Each row's `steps` tokens. The wait polls, sleeping: a server's HTTP thread needs the
        GIL meanwhile, and the GPU has the next run queued (a few us late cost nothing)."""
        while self.done is not None and not self.done.query():
            time.sleep(POLL_SECONDS)
        return self.host_tokens.T.tolist()


def row_bucket(rows: int) -> int:
    """The padded batch size: 1, 2, 4, 8, then the next multiple of 8."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


def block_bucket(blocks: int) -> int:
    return 1 << (blocks - 1).bit_length()


class DecodeGraphs:
    """`forward(ids [rows], positions [rows], block tables [rows, blocks]) -> logits [rows, vocab]`,
    replayed from CUDA graphs; with `state_slots`, forward's fourth input is each row's slot
    [rows] in the recurrent layers' state pool (tessera.inference.recurrent_state)."""

    def __init__(self, forward: Forward, *, max_rows: int, max_blocks: int, device: torch.device,
                 vocab_size: int, max_steps: int = 1, compile: bool = True, state_slots: bool = False):
        self.forward = torch.compile(forward) if compile else forward
        self.vocab_size = vocab_size
        self.compiled = compile
        self.max_rows, self.max_blocks = row_bucket(max_rows), block_bucket(max_blocks)
        buffers = dict(ids=(self.max_rows,), positions=(self.max_rows,), tables=(self.max_rows, self.max_blocks))
        if state_slots:
            buffers["slots"] = (self.max_rows,)
        self.device_inputs = {name: torch.zeros(shape, dtype=torch.int64, device=device)
                              for name, shape in buffers.items()}
        self.host_inputs = {name: torch.zeros(shape, dtype=torch.int64, pin_memory=True)
                            for name, shape in buffers.items()}
        self.tokens = torch.zeros(max_steps, self.max_rows, dtype=torch.int64, device=device)   # a greedy run's tokens
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._copied = torch.cuda.Event()
        self._last_run: GreedyRun | None = None
        self.capture_seconds = 0.0   # host time spent capturing (the engine stalls meanwhile)

    def __call__(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
                 slots: Sequence[int] = ()) -> torch.Tensor:
        graph, logits = self._graph(len(ids), tables, greedy=False)
        self._fill(ids, positions, tables, slots)
        self._last_run = None   # its inputs are overwritten
        graph.replay()
        return logits[:len(ids)]

    def start_greedy(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
                     steps: int, slots: Sequence[int] = ()) -> GreedyRun:
        """Queue `steps` greedy decode steps from tokens `ids` at `positions` (the tables covering
        positions + steps)."""
        self._fill(ids, positions, tables, slots)
        return self._run_greedy(len(ids), tables, steps)

    def continue_greedy(self, run: GreedyRun, tables: Sequence[Sequence[int]], steps: int) -> GreedyRun:
        """Queue `steps` more greedy steps of the rows of `run`, the last run queued, from the tokens and
        positions it leaves on the device (the tables covering them)."""
        if run is not self._last_run:
            raise ValueError("continue_greedy continues the last greedy run queued")
        self._fill_tables(tables)
        return self._run_greedy(run.rows, tables, steps)

    def prepare(self, count: int) -> None:
        """Capture the graphs of `count` rows at every block-table width (greedy runs' too where they
        are on), so that a request growing longer never waits mid-stream for a capture."""
        modes = (False, True) if self.tokens.shape[0] > 1 else (False,)   # greedy runs longer than one step
        width = 1
        while width <= self.max_blocks:
            for greedy in modes:
                self._graph(count, [[0] * width] * count, greedy)
            width *= 2

    def _run_greedy(self, count: int, tables: Sequence[Sequence[int]], steps: int) -> GreedyRun:
        if not 1 <= steps <= self.tokens.shape[0]:
            raise ValueError(f"steps must be in 1..{self.tokens.shape[0]}, got {steps}")
        graph, _ = self._graph(count, tables, greedy=True)
        rows = row_bucket(count)
        for step in range(steps):
            graph.replay()
            self.tokens[step, :rows].copy_(self.device_inputs["ids"][:rows])
        host = torch.empty(steps, count, dtype=torch.int64, pin_memory=True)
        host.copy_(self.tokens[:steps, :count], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._last_run = GreedyRun(count, steps, host, done)
        return self._last_run

    def _graph(self, count: int, tables: Sequence[Sequence[int]], greedy: bool
               ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        rows = row_bucket(count)
        blocks = min(block_bucket(max(len(t) for t in tables)), self.max_blocks)
        return self.graphs.get((rows, blocks, greedy)) or self._capture(rows, blocks, greedy)

    def _fill(self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]],
              slots: Sequence[int]) -> None:
        self._fill_tables(tables)
        rows = row_bucket(len(ids))
        for name, values in (("ids", ids), ("positions", positions), ("slots", slots)):
            if name not in self.host_inputs:   # no state slots
                continue
            host = self.host_inputs[name].numpy()
            host[:rows] = 0
            host[:len(ids)] = values
            self.device_inputs[name][:rows].copy_(self.host_inputs[name][:rows], non_blocking=True)
        self._copied.record()

    def _fill_tables(self, tables: Sequence[Sequence[int]]) -> None:
        self._copied.synchronize()   # the host buffers' last copies (runs may still be queued) have been made
        rows = row_bucket(len(tables))
        host = self.host_inputs["tables"].numpy()
        host[:rows] = 0
        for row, table in enumerate(tables):
            host[row, :len(table)] = table
        self.device_inputs["tables"][:rows].copy_(self.host_inputs["tables"][:rows], non_blocking=True)
        self._copied.record()

    def _inputs(self, rows: int, blocks: int) -> tuple[torch.Tensor, ...]:
        """forward's inputs: ids, positions, tables (and state slots) of `rows` rows and `blocks` blocks."""
        d = self.device_inputs
        slots = (d["slots"][:rows],) if "slots" in d else ()
        return d["ids"][:rows], d["positions"][:rows], d["tables"][:rows, :blocks], *slots

    def _step(self, greedy: bool, ids: torch.Tensor, positions: torch.Tensor,
              *tables_and_slots: torch.Tensor) -> torch.Tensor:
        logits = self.forward(ids, positions, *tables_and_slots)
        if greedy:   # the next step's inputs
            argmax_into(logits, self.vocab_size, ids)
            positions.add_(1)
        return logits

    def _capture(self, rows: int, blocks: int, greedy: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture a shape's graph; the inputs' buffers are as they were (a greedy run may continue from them)."""
        start = time.perf_counter()
        saved = {name: tensor.clone() for name, tensor in self.device_inputs.items()}
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
                self._step(greedy, *inputs)
        torch.cuda.current_stream().wait_stream(side)
        for tensor in inputs:   # the warm-up's greedy steps moved the positions on
            tensor.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(greedy, *inputs)
        self._pool = graph.pool()
        self.graphs[(rows, blocks, greedy)] = graph, logits
        for name, tensor in self.device_inputs.items():
            tensor.copy_(saved[name])
        self.capture_seconds += time.perf_counter() - start
        return graph, logits


def token_bucket(tokens: int) -> int:
    """A step's padded token count: a power of two up to 512 (at least 16), then a multiple of 512."""
    return max(16, 1 << (tokens - 1).bit_length()) if tokens <= 512 else -(-tokens // 512) * 512


def padded_prompts(lengths: Sequence[int]) -> tuple[int, list[int]]:
    """The padded layout of a step of prompts of `lengths`: (its tokens, its documents' bounds).
    The prompts' tokens are padded to a `token_bucket` and their documents to a `row_bucket`
    with padding documents of one token or more (so that no document is empty)."""
    total, prompts = sum(lengths), len(lengths)
    tokens, documents = token_bucket(total), row_bucket(prompts)
    if tokens > total and documents == prompts:   # the padding tokens need a document
        documents = row_bucket(prompts + 1)
    if tokens - total < documents - prompts:      # and every padding document a token
        tokens = token_bucket(total + documents - prompts)
    padding = range(1, documents - prompts) if documents > prompts else ()
    bounds = [0, *itertools.accumulate(lengths), *(total + i for i in padding)]
    return tokens, bounds + [tokens] if documents > prompts else bounds


class PromptGraphs:
    """`forward(ids [1, tokens], positions [1, tokens], step, last [prompts]) -> logits at `last``
    for steps of fresh prompts only, replayed from CUDA graphs, one per padded layout."""

    def __init__(self, forward: PromptForward, pools, block_size: int, *, max_tokens: int, max_prompts: int,
                 device: torch.device):
        self.forward, self.pools, self.block_size = forward, pools, block_size
        documents = row_bucket(max_prompts + 1)
        self.max_tokens = token_bucket(max_tokens + documents)
        shapes = dict(ids=(self.max_tokens,), positions=(self.max_tokens,), slots=(self.max_tokens,),
                      bounds=(documents + 1,), last=(documents,))
        dtypes = dict(bounds=torch.int32)
        self.device_inputs = {name: torch.zeros(shape, dtype=dtypes.get(name, torch.int64), device=device)
                              for name, shape in shapes.items()}
        self.host_inputs = {name: torch.zeros(shape, dtype=dtypes.get(name, torch.int64), pin_memory=True)
                            for name, shape in shapes.items()}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.capture_seconds = 0.0

    def fits(self, lengths: Sequence[int]) -> bool:
        return padded_prompts(lengths)[0] <= self.max_tokens

    def __call__(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                 lengths: Sequence[int]) -> torch.Tensor:
        """Logits [prompts, vocab] at each prompt's last token; ids, positions and cache slots
        [tokens] of the prompts laid end to end."""
        tokens, bounds = padded_prompts(lengths)
        self._fill(ids, positions, slots, bounds)
        graph, logits = self.graphs.get((tokens, len(bounds) - 1)) or self._capture(tokens, bounds)
        graph.replay()
        return logits[:len(lengths)]

    def _fill(self, ids, positions, slots, bounds: list[int]) -> None:
        host = {name: tensor.numpy() for name, tensor in self.host_inputs.items()}
        tokens, count = bounds[-1], len(ids)
        for name, values in (("ids", ids), ("positions", positions), ("slots", slots)):
            host[name][:tokens] = 0   # padding: token 0 at position 0, written into the null block
            host[name][:count] = values
        host["bounds"][:len(bounds)] = bounds
        host["last"][:len(bounds) - 1] = [end - 1 for end in bounds[1:]]
        sizes = dict(ids=tokens, positions=tokens, slots=tokens, bounds=len(bounds), last=len(bounds) - 1)
        for name, tensor in self.device_inputs.items():
            tensor[:sizes[name]].copy_(self.host_inputs[name][:sizes[name]], non_blocking=True)

    def _capture(self, tokens: int, bounds: list[int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        start = time.perf_counter()
        d = self.device_inputs
        ids, positions, slots = (d[name][:tokens][None] for name in ("ids", "positions", "slots"))
        layout = Documents.from_cu_seqlens(torch.tensor(bounds), 1, tokens, backend="varlen", device=d["ids"].device)
        step = StepAttention(self.pools, self.block_size, slots[0])
        step.fresh = dataclasses.replace(layout, cu_seqlens=d["bounds"][:len(bounds)], max_seqlen=tokens)
        last = d["last"][:len(bounds) - 1]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up outside the capture (it writes what the replay writes)
            self.forward(ids, positions, step, last)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(ids, positions, step, last)
        self._pool = graph.pool()
        self.graphs[(tokens, len(bounds) - 1)] = graph, logits
        self.capture_seconds += time.perf_counter() - start
        return graph, logits

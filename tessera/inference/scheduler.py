"""Continuous batching: which requests run in the next forward pass, and on how many tokens.

Each step has a budget of `max_batched_tokens`. Running requests come first, in the order
they were admitted: one token each while decoding, or the next chunk of a prompt that did
not fit a step (chunked prefill). Waiting requests are then admitted in arrival order while
the budget, the KV blocks and `max_requests` allow. A prompt longer than what is left of the
budget is cut (its first chunk now) only when no other prompt is in the step; otherwise it
waits for the next one, where it comes first: the rest of a cut prompt is a continued row,
and steps with one run eagerly (tessera.inference.runner: ~30 ms of host time on an H200 for
config B, where a graphed step of fresh prompts needs a few).

A request's tokens are its prompt and what it generated; `computed` of them are in the
cache. A step computes the next `count` tokens; when that reaches the last token, the
step's logits at that token give the request its next token. So prefill, a chunk and a
decode step are one thing of different sizes, and so is the recompute after preemption.

Each running request also holds one of `max_requests` state slots, where recurrent layers
(Mamba-2) keep its state (tessera.inference.recurrent_state); admission gives one, finishing
and preemption take it back. With prefix caching such a model's requests reuse cached blocks
only up to the last one whose end has a saved state (tessera.inference.state_snapshots): the
first row after admission has that state copied into the request's slot (`restore`), and a
multi-token row saves the state at the block ends the request chose (`saves`); a row of one
token saves none.

Preemption by recompute (vLLM, Megatron's eviction): when a running request needs a
block and none is free, the most recently admitted running request gives back all its
blocks (and its state slot) and goes to the head of the waiting queue; when it is admitted
again its prompt and generated tokens are computed again (with prefix caching, its full
blocks are usually still there). No step admits new requests while it preempts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import torch

from tessera.inference.kv_cache import BlockAllocator
from tessera.inference.sampling import SamplingParams
from tessera.inference.state_snapshots import StateSnapshots


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0            # tokens whose keys and values are in the cache
    block_names: list[int] = field(default_factory=list)   # prefix-cache names of its leading full blocks
    state_slot: int | None = None   # while running: its slot in the recurrent layers' state pool
    resume_slot: int | None = None  # admitted after a cached prefix: the snapshot its state starts from
    save_points: list[int] = field(default_factory=list)   # positions (block ends) whose state it saves
    preemptions: int = 0
    finish_reason: str | None = None
    routed_experts: torch.Tensor | None = None   # with routing recorded: tessera.inference.routing

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token(self, position: int) -> int:
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < prompt else self.output_token_ids[position - prompt]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_token_ids + self.output_token_ids)[start:end]


@dataclass(frozen=True)
class ScheduledRow:
    """`count` tokens of `request` from position `start`; `samples`: this reaches its last token.
    Recurrent layers: `restore`, the snapshot slot whose state the request's slot takes first;
    `saves`, (tokens into the row, snapshot slot) where the state after them is saved."""

    request: Request
    start: int
    count: int
    restore: int | None = None
    saves: tuple[tuple[int, int], ...] = ()

    @property
    def samples(self) -> bool:
        return self.start + self.count == self.request.num_tokens


class Scheduler:
    def __init__(self, allocator: BlockAllocator, *, max_requests: int, max_batched_tokens: int,
                 snapshots: StateSnapshots | None = None):
        self.allocator = allocator
        self.snapshots = snapshots   # with prefix caching and recurrent layers
        if snapshots is not None:
            allocator.on_evict = snapshots.forget
        self.block_size = allocator.block_size
        self.max_requests, self.max_batched_tokens = max_requests, max_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(max_requests, 0, -1))   # 1..max_requests, lowest first; 0 is the null slot
        self.preemptions = 0            # so far, all requests
        self.cached_tokens = 0          # tokens found in the prefix cache instead of computed

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledRow]:
        budget = self.max_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: set[int] = set()   # ids of the requests preempted this step
        for request in list(self.running):
            if budget == 0:
                break
            if id(request) in preempted:   # for an earlier one
                continue
            count = min(request.num_tokens - request.computed, budget)
            while not self.reserve(request, request.computed + count):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is request:
                    break
            else:
                rows.append(self._row(request, count))
                budget -= count
        prompt_in_step = any(row.count > 1 for row in rows)
        while self.waiting and budget and not preempted and len(self.running) < self.max_requests:
            request = self.waiting[0]   # nothing computed: preempted and refused requests gave all back
            self._reuse_cached_prefix(request)
            count = min(request.num_tokens - request.computed, budget)
            cut = count < request.num_tokens - request.computed
            if (cut and prompt_in_step) or not self.reserve(request, request.computed + count):
                self._release(request)   # gives back the cached prefix too, until it is admitted
                break
            prompt_in_step = prompt_in_step or count > 1
            self.waiting.popleft()
            self.running.append(request)
            request.state_slot = self._free_slots.pop()
            self.cached_tokens += request.computed
            rows.append(self._row(request, count))
            budget -= count
        return rows

    def _row(self, request: Request, count: int) -> ScheduledRow:
        """The request's next `count` tokens, with the state it restores first and the snapshots it saves."""
        start, end = request.computed, request.computed + count
        saves = []
        if request.save_points and count > 1:
            for point in request.save_points:
                slot = self.snapshots.reserve() if point <= end else None
                if slot is not None:
                    saves.append((point - start, slot))
        request.save_points = [point for point in request.save_points if point > end]
        restore, request.resume_slot = request.resume_slot, None
        return ScheduledRow(request, start, count, restore, tuple(saves))

    def computed(self, rows: list[ScheduledRow]) -> None:
        """After a step: its tokens are in the cache; name the blocks that became full."""
        for row in rows:
            request = row.request
            request.computed = row.start + row.count
            full, named = request.computed // self.block_size, len(request.block_names)
            if self.allocator.prefix_caching and full > named:
                names = self.allocator.block_names(request.tokens(0, full * self.block_size), full, named,
                                                   request.block_names[-1] if named else None)
                for block, name in zip(request.blocks[named:], names):
                    self.allocator.remember(block, name)
                request.block_names += names
            for offset, slot in row.saves:
                self.snapshots.publish(request.block_names[(row.start + offset) // self.block_size - 1], slot)

    def finish(self, request: Request) -> None:
        """Drop a request (finished or aborted) wherever it is, and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def blocks_needed(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def reserve(self, request: Request, tokens: int) -> bool:
        """Blocks for `request`'s first `tokens` tokens, if they are free (nothing taken otherwise)."""
        missing = self.blocks_needed(tokens) - len(request.blocks)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free:
            return False
        request.blocks += self.allocator.allocate(missing)
        return True

    def _reuse_cached_prefix(self, request: Request) -> None:
        # At least the last token is computed: its logits give the next token.
        limit = (request.num_tokens - 1) // self.block_size
        if self.allocator.prefix_caching and limit:
            request.blocks, request.block_names = self.allocator.cached_prefix(
                request.tokens(0, limit * self.block_size), limit)
            if self.snapshots is not None:
                self._resume_at_a_snapshot(request)
            request.computed = len(request.blocks) * self.block_size

    def _resume_at_a_snapshot(self, request: Request) -> None:
        """Keep the cached blocks up to the last one whose end has a recurrent state saved, and choose the
        block ends the request saves: where its cached blocks ended, and its prompt's last reusable one."""
        kept, request.resume_slot = self.snapshots.longest(request.block_names)
        found = len(request.blocks)
        self.allocator.free(request.blocks[kept:])
        del request.blocks[kept:], request.block_names[kept:]
        last_reusable = (len(request.prompt_token_ids) - 1) // self.block_size
        request.save_points = [block * self.block_size for block in sorted({found, last_reusable}) if block > kept]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.allocator.free(request.blocks)
        request.blocks, request.block_names = [], []
        request.computed = 0
        request.resume_slot, request.save_points = None, []
        if request.state_slot is not None:
            self._free_slots.append(request.state_slot)
            request.state_slot = None

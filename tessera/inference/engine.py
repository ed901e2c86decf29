"""The inference engine: requests in, tokens out, many requests sharing each forward pass.

    engine = Engine(model, max_requests=64, eos_token_ids=[2])
    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished_requests():
        for output in engine.step():          # new tokens of each request that got one
            ...
    completions = engine.generate([ids_1, ids_2], SamplingParams(temperature=0))   # or all at once

Each `step` is one scheduler step (tessera.inference.scheduler: prefill chunks and decode
tokens under a token budget, continuous batching, preemption), one forward pass over the
paged KV cache (tessera.inference.runner, kv_cache, paged_attention; CUDA graphs for decode
steps on a GPU; the per-request state of a hybrid's Mamba-2 and Gated DeltaNet layers in
tessera.inference.recurrent_state) and one sampling pass (tessera.inference.sampling). Synchronous and
single-threaded; requests beyond capacity wait in its queue.

Under tensor parallelism every rank of the TP group builds the same engine and is given
the same requests in the same order: the logits are gathered over TP, and sampling is a
function of the logits and each request's seed, so every rank picks the same tokens and
the ranks stay in step with no other communication.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from tessera.inference.cuda_graphs import GreedyRun
from tessera.inference.kv_cache import PagedKVCache
from tessera.inference.recurrent_state import StatePool
from tessera.inference.routing import RoutingRecorder
from tessera.inference.runner import ModelRunner
from tessera.inference.sampling import Sampler, SamplingParams
from tessera.inference.scheduler import Request, ScheduledRow, Scheduler
from tessera.inference.state_snapshots import StateSnapshots
from tessera.models.gpt import GPTModel


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]                          # new tokens since this request's previous output
    logprobs: list[float] | None                  # one per new token, when params.logprobs is not None
    top_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None                     # "stop" (EOS or a stop token), "length", "abort"
    prompt_tokens: int
    completion_tokens: int                        # all generated so far


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    routed_experts: torch.Tensor | None = None   # [tokens, MoE layers, k] with `record_routing`


class Engine:
    """Continuous batching over a paged KV cache, for one GPTModel (this rank's shard under TP).

    `num_blocks` defaults to room for `max_requests` requests of `max_seq_length` tokens (on
    CUDA at most `kv_memory_fraction` of the free memory, less the recurrent layers' state of
    `max_requests` requests and of the snapshots below when the model has such layers); with
    fewer, requests are preempted and recomputed when the blocks run out. `prefix_caching` (off by
    default, as Megatron's --inference-dynamic-batching-prefix-caching) reuses the KV blocks of
    prompts that start alike; on CUDA the rest of such a prompt runs eagerly (docs/inference.md),
    so it pays for long shared prefixes only. With recurrent layers it also keeps `state_snapshots`
    (default `max_requests`) of their states at block ends, and reuses blocks up to the last one
    whose end has one (tessera.inference.state_snapshots). `vocab_size` (default the model
    config's) excludes the output layer's padding rows from sampling. On CUDA, decode steps
    replay CUDA graphs (`cuda_graphs`) of the decode step compiled with torch.compile (`compile`;
    the first step of each new batch shape captures its graph, and the first one compiles, tens
    of seconds for a 1B model).
    Steps of new prompts replay CUDA graphs of their own (bf16 and fp16), beside the decode
    graphs when decode rows share the step (tessera.inference.runner).
    When every running request decodes greedily (no penalties, no log-probs) and none waits,
    up to `decode_steps` steps run back to back on the device (replays of one CUDA graph on
    CUDA) and their tokens come in one output; a request that ends within them keeps its
    tokens up to its end. While the same requests keep decoding so, the next run is queued
    before the host reads the last one (the GPU does not wait for the host between them); a
    request that ends in a run has its tokens of the queued run dropped.
    `record_routing` (MoE models) records the experts of every token of each request, returned with
    its Completion (tessera.inference.routing); its steps run eagerly, one at a time.
    """

    def __init__(self, model: GPTModel, *, max_requests: int = 64, max_seq_length: int | None = None,
                 block_size: int = 16, num_blocks: int | None = None, max_batched_tokens: int = 2048,
                 eos_token_ids: Sequence[int] = (), seed: int = 0, prefix_caching: bool = False,
                 cuda_graphs: bool = True, compile: bool = True, kv_memory_fraction: float = 0.8,
                 vocab_size: int | None = None, decode_steps: int = 16, record_routing: bool = False,
                 state_snapshots: int | None = None):
        config = model.config
        limit = config.max_position_embeddings or config.seq_length
        self.max_seq_length = max_seq_length or limit
        for name, value, low in (("max_requests", max_requests, 1), ("block_size", block_size, 1),
                                 ("max_batched_tokens", max_batched_tokens, 1), ("decode_steps", decode_steps, 1),
                                 ("max_seq_length", self.max_seq_length, 1)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.max_seq_length > limit:
            raise ValueError(f"max_seq_length ({self.max_seq_length}) exceeds the model's position limit ({limit})")
        self.model = model.eval()
        self.vocab_size = vocab_size or config.vocab_size or model.vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        parameter = next(model.parameters())
        shapes, state_shapes = PagedKVCache.model_shapes(model), StatePool.model_shapes(model)
        if state_snapshots is not None and state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {state_snapshots}")
        snapshots = None   # which pool slots hold states saved at block ends, with prefix caching
        if state_shapes and prefix_caching:
            snapshots = StateSnapshots(max_requests + 1, max_requests if state_snapshots is None else state_snapshots)
        # the null slot 0, one per running request, the snapshots
        state_slots = max_requests + 1 + (snapshots.count if snapshots is not None else 0)
        blocks_per_request = math.ceil(self.max_seq_length / block_size)
        if num_blocks is None:
            num_blocks = max_requests * blocks_per_request + 1
            if parameter.device.type == "cuda":
                num_blocks = _blocks_that_fit(num_blocks, shapes, block_size, parameter,
                                              StatePool.bytes_per_slot(state_shapes) * state_slots,
                                              kv_memory_fraction)
        self.cache = PagedKVCache(shapes, num_blocks, block_size, dtype=parameter.dtype, device=parameter.device,
                                  prefix_caching=prefix_caching)
        self.states = StatePool(state_shapes, state_slots, parameter.device) if state_shapes else None
        self.scheduler = Scheduler(self.cache.allocator, max_requests=max_requests,
                                   max_batched_tokens=max_batched_tokens, snapshots=snapshots)
        if record_routing:
            decode_steps = 1   # a greedy run's steps chain on the device, routing unread
        self.runner = ModelRunner(model, self.cache, self.vocab_size, max_rows=max_requests,
                                  max_blocks=blocks_per_request, max_tokens=max_batched_tokens,
                                  cuda_graphs=cuda_graphs, compile=compile,
                                  decode_steps=decode_steps, states=self.states,
                                  recorder=RoutingRecorder(model) if record_routing else None)
        self.decode_steps = decode_steps
        self.sampler = Sampler(self.vocab_size, self.eos_token_ids)
        self._generator = torch.Generator().manual_seed(seed)
        self._requests: dict[str, Request] = {}
        self._aborted: list[RequestOutput] = []
        self._greedy_run: tuple[list[ScheduledRow], GreedyRun] | None = None   # queued, its tokens not read
        self._generate_ids = itertools.count()

    # -- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; ValueError (naming the problem) if it can never run."""
        params.validate()
        if request_id in self._requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        total = len(prompt) + params.max_tokens
        if total > self.max_seq_length:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                             f"the maximum sequence length ({self.max_seq_length})")
        usable = self.cache.num_blocks - 1
        if self.scheduler.blocks_needed(total) > usable:
            raise ValueError(f"the prompt plus max_tokens ({total} tokens) needs more than the KV cache's "
                             f"{usable} blocks of {self.cache.block_size}")
        seed = params.seed if params.seed is not None else \
            int(torch.randint(0, 2**62, (1,), generator=self._generator))
        request = Request(request_id, prompt, params, seed)
        self._requests[request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its finished output (reason "abort") comes with the next step. Unknown ids: no-op."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        request.finish_reason = "abort"
        self.scheduler.finish(request)
        self._aborted.append(self._output(request, [], None, None, "abort"))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._aborted)

    # -- stepping -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step: the outputs of every request that got a token, finished or was aborted."""
        outputs, self._aborted = self._aborted, []
        if self._greedy_run is not None:
            outputs += self._collect_greedy_run()
            if self._greedy_run is not None:   # the next one is queued
                return outputs
        rows = self.scheduler.schedule()
        if not rows:
            return outputs
        steps = self._greedy_steps(rows)
        if steps > 1:
            self._greedy_run = rows, self.runner.start_greedy(rows, steps)
            return outputs + self._collect_greedy_run()
        logits = self.runner.run(rows)
        self.scheduler.computed(rows)
        requests = [row.request for row in rows if row.samples]
        if not requests:   # only prompt chunks
            return outputs
        samples = self.sampler(logits, requests)
        for request, token, logprob, top in zip(requests, samples.token_ids, samples.logprobs, samples.top_logprobs):
            if logprob is not None:
                request.logprobs.append(logprob)
                request.top_logprobs.append(top)
            reason = self._append(request, [token])
            outputs.append(self._end(request, reason, [token], None if logprob is None else [logprob],
                                     None if logprob is None else [top]))
        return outputs

    def _greedy_steps(self, rows: Sequence[ScheduledRow]) -> int:
        """How many decode steps the rows can run on the GPU without the host (1: just this one).

        Greedy rows without penalties or log-probs only (their next token is the argmax), none
        waiting to be admitted, at most `decode_steps` and the fewest tokens any row has left;
        the blocks for all of them reserved now."""
        if self.decode_steps == 1 or self.scheduler.waiting:
            return 1
        for row in rows:
            p, generated = row.request.params, len(row.request.output_token_ids)
            if row.count != 1 or not p.greedy or p.logprobs is not None or p.repetition_penalty != 1 \
                    or p.presence_penalty or p.frequency_penalty or generated < p.min_tokens:
                return 1
        return self._reserved_run(rows, queued=0)

    def _reserved_run(self, rows: Sequence[ScheduledRow], queued: int) -> int:
        """Steps for a run of `rows` after `queued` steps not yet read: at most `decode_steps` and the
        fewest tokens any row has left, the blocks for all of them reserved now (1: no run)."""
        steps = min(self.decode_steps,
                    *(r.request.params.max_tokens - len(r.request.output_token_ids) - queued for r in rows))
        if steps <= 1 or not all(self.scheduler.reserve(r.request, r.start + queued + steps) for r in rows):
            return 1
        return steps

    def _collect_greedy_run(self) -> list[RequestOutput]:
        """The tokens of the greedy run in flight, each request's up to its end; the next run of
        the same rows is queued first where `_next_greedy_steps` allows (then it is in flight)."""
        rows, run = self._greedy_run
        steps = self._next_greedy_steps(rows, run.steps)
        self._greedy_run = None
        if steps > 1:
            after = [ScheduledRow(row.request, row.start + run.steps, 1) for row in rows]
            self._greedy_run = after, self.runner.continue_greedy(run, after, steps)
        outputs = []
        for row, tokens in zip(rows, run.tokens()):
            request = row.request
            if request.finish_reason is not None:   # ended in the run before, or aborted
                continue
            kept = next((n for n in range(1, run.steps + 1) if self._finish_reason(request, tokens[n - 1], n)),
                        run.steps)
            reason = self._append(request, tokens[:kept])
            self.scheduler.computed([ScheduledRow(request, row.start, kept)])   # names the blocks it filled
            outputs.append(self._end(request, reason, tokens[:kept], None, None))
        return outputs

    def _next_greedy_steps(self, rows: Sequence[ScheduledRow], queued: int) -> int:
        """How many greedy steps to queue after a run of `queued` steps of `rows` before reading it
        (1: none): while every one of them runs and no other request does or waits, as
        `_greedy_steps` would give once their tokens are in, supposing none of them ends in the
        run (one that does has the next run's tokens dropped)."""
        if self.scheduler.waiting or len(self.scheduler.running) != len(rows) \
                or any(row.request.finish_reason is not None for row in rows):
            return 1
        return self._reserved_run(rows, queued)

    def _append(self, request: Request, tokens: list[int]) -> str | None:
        """Give a request its new tokens; why the last one ends it, if it does."""
        reason = self._finish_reason(request, tokens[-1], len(tokens))
        request.output_token_ids += tokens
        return reason

    def _end(self, request: Request, reason: str | None, tokens: list[int], logprobs, top) -> RequestOutput:
        """The output of a request's new tokens; the request is finished if `reason`."""
        if reason is not None:
            request.finish_reason = reason
            self.scheduler.finish(request)
            del self._requests[request.request_id]
        return self._output(request, tokens, logprobs, top, reason)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Run `prompts` to completion (with any requests already queued, whose outputs are dropped)
        and return them in order."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        batch = next(self._generate_ids)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.add_request(request_id, prompt, p)
        requests = [self._requests[i] for i in ids]
        while any(r.finish_reason is None for r in requests):
            self.step()
        return [Completion(r.prompt_token_ids, r.output_token_ids,
                           r.logprobs if r.params.logprobs is not None else None,
                           r.top_logprobs if r.params.logprobs is not None else None, r.finish_reason,
                           r.routed_experts[:r.num_tokens] if r.routed_experts is not None else None)
                for r in requests]

    def warm_up(self) -> float:
        """Run the kinds of step a server meets on throwaway greedy requests, so that the first real
        ones do not wait for torch.compile and CUDA graph capture (tens of seconds on a GPU): one
        request alone (a prompt's graph, the single-row decode step), then two decoding while a
        third prompt arrives (the batched decode step beside a prompt); then the single-row decode
        graphs of every block-table width, so that one long request never stalls mid-stream (each
        width is a capture and a compile of the attention kernels, ~1.4 s each on an H200 for
        config B when met while serving). Returns the seconds taken; leaves no request behind and
        the engine's random generator where it was."""
        if self.has_unfinished_requests():
            raise ValueError("warm_up runs on an idle engine: requests are queued")
        start = time.perf_counter()
        prompt_length = max(1, min(16, self.max_seq_length // 2))
        params = SamplingParams(max_tokens=max(1, min(4, self.max_seq_length - prompt_length)), temperature=0,
                                ignore_eos=True)
        prompts = [[(i + j) % self.vocab_size for j in range(prompt_length)] for i in range(3)]
        random_state = self._generator.get_state()   # requests without a seed draw theirs from it
        self.generate(prompts[:1], params)
        for i, prompt in enumerate(prompts):
            self.add_request(f"warm-up-{i}", prompt, params)
            if i == 1:
                self.step()
        while self.has_unfinished_requests():
            self.step()
        self.runner.prepare_graphs(rows=1)
        self._generator.set_state(random_state)
        return time.perf_counter() - start

    def _finish_reason(self, request: Request, token: int, new: int) -> str | None:
        """Why `request` ends at `token`, its `new`-th token after those it has, if it does."""
        params = request.params
        generated = len(request.output_token_ids) + new
        stops = params.stop_token_ids if params.ignore_eos else (*self.eos_token_ids, *params.stop_token_ids)
        if token in stops and generated >= params.min_tokens:
            return "stop"
        if generated >= params.max_tokens:
            return "length"
        return None

    @staticmethod
    def _output(request: Request, tokens: list[int], logprobs, top, reason: str | None) -> RequestOutput:
        return RequestOutput(request.request_id, tokens, logprobs, top, reason is not None, reason,
                             len(request.prompt_token_ids), len(request.output_token_ids))


def _blocks_that_fit(wanted: int, shapes, block_size: int, parameter: torch.Tensor, state_bytes: int,
                     memory_fraction: float) -> int:
    """At most `wanted` KV blocks (at least 2), within `memory_fraction` of the free CUDA memory once
    the recurrent layers' state (`state_bytes`, every slot and snapshot) is counted."""
    free, _ = torch.cuda.mem_get_info(parameter.device)
    budget = int(free * memory_fraction) - state_bytes
    if budget < 0:
        raise ValueError(f"the recurrent layers' state for --inference-max-requests requests "
                         f"({state_bytes / 2**30:.2f} GiB) does not fit in {memory_fraction:.0%} of the free GPU memory: ask for fewer requests")
    per_block = PagedKVCache.bytes_per_block(shapes, block_size, parameter.dtype)
    return max(min(wanted, budget // per_block), 2) if per_block else wanted

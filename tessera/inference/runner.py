"""One forward pass of a scheduled batch: its tokens through the model, the logits it samples from.

The model is tessera's GPTModel, unchanged: its embedding, blocks and head run here on the
step's tokens laid flat ([1, tokens]), with positions given explicitly and each layer's
`LayerCache` (tessera.inference.paged_attention) in the slot of packed-document attention.
Only the last token of a row that finishes its prompt (or decodes) goes through the head.
Recurrent layers of a hybrid (Mamba-2) get the step's `StepStates` in that slot instead
(tessera.inference.recurrent_state), and MLP layers nothing.

Steps where every row decodes one token run through `DecodeGraphs` on CUDA (CUDA graphs
of the compiled decode step; several greedy steps back to back where the engine asks),
fresh prompts through `PromptGraphs` (CUDA graphs of the eager step, padded; bf16 and fp16),
and a step of both as one pass of each. Eager, config B's 24 layers cost ~30 ms of host time
per prompt step on an H200 whatever its length (the GPU needs 1.7 ms for 128 tokens); a
second pass over the weights costs ~0.6 ms. Steps with continued rows (later chunks of a
prompt, prompts after a cached prefix) run in one eager pass.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Sequence

import torch

from tessera.inference import fused_decode
from tessera.inference.cuda_graphs import DecodeGraphs, GreedyRun, PromptGraphs
from tessera.inference.kv_cache import NULL_BLOCK, PagedKVCache
from tessera.inference.paged_attention import ContinuedRow, StepAttention
from tessera.inference.recurrent_state import PromptRow, StatePool, StepStates
from tessera.inference.routing import RoutingRecorder
from tessera.inference.scheduler import ScheduledRow
from tessera.models.documents import default_backend
from tessera.models.gpt import GPTModel
from tessera.models.moe import MoELayer, grouped_mm_available
from tessera.parallel.experts import LocalDispatcher


def forward_tokens(model: GPTModel, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention,
                   logit_index: torch.Tensor | None = None, states: StepStates | None = None) -> torch.Tensor:
    """Logits [rows, padded vocab] at the tokens `logit_index` (default all) of [1, tokens] inputs."""
    hidden = model.embed(input_ids, positions)
    rope = model.rotary(input_ids.shape[1], positions) if model.rotary is not None else None
    for index, block in model.layers.items():
        if index in step.pools:
            cache = step.layer(index)
        else:   # a hybrid's recurrent layer, or one that caches nothing
            cache = states.layer(index) if states is not None else None
        hidden = block(hidden, rope, cache)
    if logit_index is not None:
        hidden = hidden[:, logit_index]
    return model.head(hidden)[0]


def decode_logits(model: GPTModel, cache: PagedKVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                  tables: torch.Tensor, slots: torch.Tensor | None = None, *, fused: bool = False,
                  states: StatePool | None = None) -> torch.Tensor:
    """One new token per row: ids and positions [rows], block tables [rows, blocks] (and with a state
    pool, state slots [rows]) -> logits [rows, padded vocab]. `fused`: a single row goes through
    tessera.inference.fused_decode (the model must be `supported` there)."""
    step = StepAttention.decode_only(cache.pools, cache.block_size, positions, tables)
    if fused and input_ids.shape[0] == 1:
        return fused_decode.decode_logits(model, input_ids, positions, step)
    recurrent = StepStates(states, slots, positions) if states is not None else None
    return forward_tokens(model, input_ids[None], positions[None], step, states=recurrent)


def graphs_supported(model: GPTModel, dtype: torch.dtype) -> bool:
    """Whether the decode step has no host sync: MoE layers need their grouped GEMMs (the loop
    over experts reads the expert sizes on the host) and all experts on this rank."""
    for layer in model.layers:
        if isinstance(getattr(layer, "mlp", None), MoELayer):
            experts = layer.mlp.experts
            if not (experts.grouped_gemm and grouped_mm_available("cuda", dtype)) \
                    or type(layer.mlp.dispatcher) is not LocalDispatcher:
                return False
    return True


class ModelRunner:
    """Runs scheduled rows through the model and returns fp32 logits over the real vocabulary."""

    def __init__(self, model: GPTModel, cache: PagedKVCache, vocab_size: int, *, max_rows: int, max_blocks: int,
                 max_tokens: int, cuda_graphs: bool, compile: bool, decode_steps: int = 1,
                 states: StatePool | None = None, recorder: RoutingRecorder | None = None):
        self.model, self.cache, self.vocab_size, self.states = model, cache, vocab_size, states
        self.recorder = recorder   # records each forward's MoE routing: eager steps only
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        # single-row decode steps through fused kernels, which compute transformer blocks only
        self.fused = model.config.hybrid_layer_pattern is None and fused_decode.supported(model) and recorder is None
        self.graphs = self.prompt_graphs = None
        self._eager_next: tuple[GreedyRun, torch.Tensor, torch.Tensor] | None = None   # continue_greedy's inputs
        if cuda_graphs and self.device.type == "cuda" and recorder is None:
            if graphs_supported(model, self.dtype):
                self.graphs = DecodeGraphs(functools.partial(decode_logits, model, cache, fused=self.fused,
                                                             states=states), max_rows=max_rows, max_blocks=max_blocks,
                                           device=self.device, vocab_size=vocab_size, max_steps=decode_steps,
                                           compile=compile, state_slots=states is not None)
                # a recurrent layer runs a prompt's rows one by one on the host: no graphs for prompt steps
                if default_backend(self.device, self.dtype, dropout=False) == "varlen" and states is None:
                    self.prompt_graphs = PromptGraphs(functools.partial(forward_tokens, model), cache.pools,
                                                      cache.block_size, max_tokens=max_tokens, max_prompts=max_rows,
                                                      device=self.device)
            else:
                warnings.warn("decode runs without CUDA graphs: the MoE layers sync with the host "
                              "(use --moe-grouped-gemm and no expert parallelism)", stacklevel=2)

    def prepare_graphs(self, rows: int) -> None:
        """Capture the decode graphs of `rows` rows at every block-table width now (with CUDA graphs)."""
        if self.graphs is not None:
            self.graphs.prepare(rows)

    def graph_captures(self) -> tuple[int, float]:
        """CUDA graphs captured so far (decode and prompt steps) and the host seconds their captures took."""
        graphs = [g for g in (self.graphs, self.prompt_graphs) if g is not None]
        return sum(len(g.graphs) for g in graphs), sum(g.capture_seconds for g in graphs)

    @torch.no_grad()
    def run(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        """Logits [rows that sample, vocab_size] (fp32), in the order of `rows`."""
        self._restore_states(rows)
        if all(row.count == 1 for row in rows):
            logits = self._decode(rows)
        else:
            logits = self._mixed(rows)
        return logits[:, :self.vocab_size].float()

    @torch.no_grad()
    def start_greedy(self, rows: Sequence[ScheduledRow], steps: int) -> GreedyRun:
        """Queue each decode row's next `steps` greedy tokens (their blocks reserved)."""
        self._restore_states(rows)
        ids, positions, tables, slots = self._decode_inputs(rows)
        if self.graphs is not None:
            return self.graphs.start_greedy(ids, positions, tables, steps, slots)
        return self._eager_greedy(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                                  tables, slots, steps)

    @torch.no_grad()
    def continue_greedy(self, run: GreedyRun, rows: Sequence[ScheduledRow], steps: int) -> GreedyRun:
        """Queue `steps` more greedy tokens of the rows of `run` (the last run queued), whose tokens the host
        has not read: `rows` name their requests and the positions after `run` (their blocks reserved)."""
        tables = [row.request.blocks for row in rows]
        if self.graphs is not None:
            return self.graphs.continue_greedy(run, tables, steps)
        last_run, last_ids, last_positions = self._eager_next
        if run is not last_run:
            raise ValueError("continue_greedy continues the last greedy run queued")
        return self._eager_greedy(last_ids, last_positions, tables, [row.request.state_slot for row in rows], steps)

    def _eager_greedy(self, ids: torch.Tensor, positions: torch.Tensor, tables: Sequence[list[int]],
                      slots: Sequence[int], steps: int) -> GreedyRun:
        table, slot_tensor = self._padded(tables), torch.tensor(slots, device=self.device)
        tokens = []
        for _ in range(steps):
            ids = decode_logits(self.model, self.cache, ids, positions, table, slot_tensor, fused=self.fused,
                                states=self.states)[:, :self.vocab_size].argmax(dim=-1)
            positions = positions + 1
            tokens.append(ids)
        run = GreedyRun(len(tables), steps, torch.stack(tokens))
        self._eager_next = run, ids, positions
        return run

    def _restore_states(self, rows: Sequence[ScheduledRow]) -> None:
        """Requests that resume after a cached prefix start from the recurrent state saved at its end."""
        for row in rows:
            if row.restore is not None:
                self.states.copy(row.restore, row.request.state_slot)

    @staticmethod
    def _decode_inputs(rows: Sequence[ScheduledRow]) -> tuple[list[int], list[int], list[list[int]], list[int]]:
        """Each row's token id, position, block table and state slot."""
        return ([row.request.token(row.start) for row in rows], [row.start for row in rows],
                [row.request.blocks for row in rows], [row.request.state_slot for row in rows])

    def _decode(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        ids, positions, tables, slots = self._decode_inputs(rows)
        if self.graphs is not None:
            return self.graphs(ids, positions, tables, slots)
        to_device = functools.partial(torch.tensor, device=self.device)
        with self._recording(rows):
            return decode_logits(self.model, self.cache, to_device(ids), to_device(positions),
                                 self._padded(tables), to_device(slots), fused=self.fused, states=self.states)

    def _recording(self, rows: Sequence[ScheduledRow]):
        """Around a forward of `rows` in this order: their MoE routing recorded, when it is."""
        return self.recorder.recording(rows) if self.recorder is not None else contextlib.nullcontext()

    def _padded(self, tables: Sequence[list[int]]) -> torch.Tensor:
        """Block tables [rows, the longest], padded with the null block."""
        width = max(len(t) for t in tables)
        return torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], device=self.device)

    def _mixed(self, rows: Sequence[ScheduledRow]) -> torch.Tensor:
        """Any rows: decode rows first, then fresh prompts, then continued ones (paged_attention's
        layout) in one eager pass; without continued rows and with prompt graphs, two graphed ones."""
        decode = [r for r in rows if r.count == 1]
        fresh = [r for r in rows if r.count > 1 and r.start == 0]
        continued = [r for r in rows if r.count > 1 and r.start > 0]
        if self.prompt_graphs is not None and not continued and self.prompt_graphs.fits([r.count for r in fresh]):
            return self._decode_then_prompts(rows, decode, fresh)
        ordered = decode + fresh + continued
        ids, positions, slots = self._token_inputs(ordered)
        to_device = lambda parts: torch.cat(parts).to(self.device)  # noqa: E731
        step = StepAttention(self.cache.pools, self.cache.block_size, to_device(slots))
        if decode:
            step.decode_tables = self._padded([r.request.blocks for r in decode])
            step.decode_positions = torch.tensor([r.start for r in decode], device=self.device)
        step.fresh = StepAttention.fresh_documents([r.count for r in fresh], self.device, self.dtype)
        step.continued = [ContinuedRow(r.count, r.start + r.count,
                                       torch.tensor(r.request.blocks, device=self.device)) for r in continued]
        states = None
        if self.states is not None:
            states = StepStates(self.states, prompts=[
                PromptRow(r.request.state_slot, r.count, r.start == 0, r.saves) for r in fresh + continued])
            if decode:
                states.decode_slots = torch.tensor([r.request.state_slot for r in decode], device=self.device)
                states.decode_positions = step.decode_positions
        ends = torch.tensor([r.count for r in ordered]).cumsum(0) - 1
        sampling = [i for i, row in enumerate(ordered) if row.samples]
        with self._recording(ordered):
            logits = forward_tokens(self.model, to_device(ids)[None], to_device(positions)[None], step,
                                    ends[sampling].to(self.device), states)
        return _in_order_of(rows, dict(zip((id(ordered[i]) for i in sampling), logits)), logits[:0])

    def _decode_then_prompts(self, rows: Sequence[ScheduledRow], decode: list[ScheduledRow],
                             fresh: list[ScheduledRow]) -> torch.Tensor:
        """The decode rows through the decode graphs, then the fresh prompts through the prompt
        graphs: the weights are read twice (~0.6 ms for config B on an H200), where one eager
        pass costs ~30 ms of host time and compiling each mix of the two a new graph."""
        logits = dict(zip(map(id, decode), self._decode(decode))) if decode else {}
        ids, positions, slots = (torch.cat(parts) for parts in self._token_inputs(fresh))
        prompt_logits = self.prompt_graphs(ids, positions, slots, [r.count for r in fresh])
        logits.update(zip(map(id, fresh), prompt_logits))
        return _in_order_of(rows, logits, prompt_logits[:0])

    def _token_inputs(self, rows: Sequence[ScheduledRow]) -> tuple[list, list, list]:
        """Each row's token ids, positions and cache slots (host tensors)."""
        ids, positions, slots = [], [], []
        for row in rows:
            span = torch.arange(row.start, row.start + row.count)
            blocks = torch.tensor(row.request.blocks)
            ids.append(torch.tensor(row.request.tokens(row.start, row.start + row.count)))
            positions.append(span)
            slots.append(blocks[span // self.cache.block_size] * self.cache.block_size + span % self.cache.block_size)
        return ids, positions, slots


def _in_order_of(rows: Sequence[ScheduledRow], logits: dict[int, torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    """The logits of the rows that sample, in the order of `rows` (`logits` by id of row; `empty` if none samples)."""
    picked = [logits[id(row)] for row in rows if row.samples]
    return torch.stack(picked) if picked else empty

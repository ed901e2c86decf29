"""The per-request state of recurrent layers (Mamba-2, Gated DeltaNet), which they keep in place of KV blocks.

An attention layer's past is its keys and values, one slot per token in paged blocks
(tessera.inference.kv_cache). A recurrent mixer's past is a state of fixed size per request:
for Mamba-2 the last three inputs of its convolution and the SSM state [heads, P, N] (arXiv
2405.21060; Megatron-Core's MambaMixer keeps the same two per request in its inference
context, transformers' Mamba2 in its cache); for Gated DeltaNet the last conv-kernel - 1 inputs
of its convolution and the delta rule's state [heads, key dim, value dim] (arXiv 2412.06464;
transformers' Qwen3-Next cache keeps the same two). The engine owns one `StatePool` beside the KV
cache: every recurrent layer's states for `max_requests + 1` slots (and prefix caching's
snapshots after them), in fp32. A running request holds one slot (tessera.inference.scheduler
hands it out at admission and takes it back when the request finishes or is preempted). Slot 0 is never handed out: the padded rows of a
CUDA-graph batch write there, as they write into KV block 0.

A step's rows, in the runner's order (decode rows, then multi-token rows):

- decode rows, one token each: `mixer.step` on all of them at once, their states gathered
  from their slots and written back on the device (no host work, so the CUDA graphs of the
  decode step capture it); a row at position 0 (a one-token prompt) starts from zeros;
- multi-token rows (a prompt, or a chunk of one): `mixer.prefill` one row at a time, from
  zeros when the row starts the request, else from its slot (the chunk before it left it there).

Preemption recomputes a request from its first token, so its state is rebuilt as its KV
blocks are. With prefix caching the pool has more slots, snapshots of states at block ends
(tessera.inference.state_snapshots): a prompt row saves its state into them at the ends it is
given (`PromptRow.saves`, the prefill cut there), and a request that resumes after a cached
prefix has the snapshot copied into its slot first (`StatePool.copy`).

A mixer plugs in by implementing `RecurrentMixer` (tessera.models.mamba.MambaMixer and
tessera.models.gated_deltanet.GatedDeltaNet do) and sitting in a HybridLayer as its `mixer`: the
engine finds it, sizes the pool from its `state_shapes`, and HybridLayer hands it to
`LayerStates.mix` when the engine runs the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

State = dict[str, torch.Tensor]
StateShapes = dict[int, dict[str, tuple[int, ...]]]   # layer index -> state name -> one request's shape


@runtime_checkable
class RecurrentMixer(Protocol):
    """What a sequence mixer with a fixed-size state gives the engine. States are dicts of
    tensors [rows, *shape] by name; what a mixer returns is stored in fp32."""

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """One request's states, by name (this tensor-parallel rank's part)."""

    def prefill(self, hidden: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """hidden [rows, s, h] following `state` -> (the output [rows, s, h], the state after the last token)."""

    def step(self, hidden: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One token a row, hidden [rows, 1, h]: (the output, the state advanced by one token)."""


def recurrent_mixers(model: nn.Module) -> dict[int, RecurrentMixer]:
    """The model's recurrent mixers by global layer index; ValueError for a mixer that is not one."""
    mixers = {index: layer.mixer for index, layer in model.layers.items() if hasattr(layer, "mixer")}
    for index, mixer in mixers.items():
        if not isinstance(mixer, RecurrentMixer):
            raise ValueError(f"layer {index}: generation with {type(mixer).__name__} layers is not supported yet "
                             "(they keep no per-request state: tessera.inference.recurrent_state.RecurrentMixer)")
    return mixers


class StatePool:
    """Every recurrent layer's states, `states[layer][name]` [num_slots, *shape] in fp32."""

    def __init__(self, shapes: StateShapes, num_slots: int, device):
        self.num_slots = num_slots
        self.states = {index: {name: torch.zeros(num_slots, *shape, device=device) for name, shape in layer.items()}
                       for index, layer in shapes.items()}

    def copy(self, source: int, target: int) -> None:
        """Slot `target` takes every layer's state in slot `source`."""
        for layer in self.states.values():
            for pool in layer.values():
                pool[target] = pool[source]

    @staticmethod
    def model_shapes(model: nn.Module) -> StateShapes:
        return {index: mixer.state_shapes() for index, mixer in recurrent_mixers(model).items()}

    @staticmethod
    def bytes_per_slot(shapes: StateShapes) -> int:
        return 4 * sum(math.prod(shape) for layer in shapes.values() for shape in layer.values())


@dataclass(frozen=True)
class PromptRow:
    """A multi-token row: `length` tokens of the request in `slot`, from zeros when `first` (they
    start the request), else after the state in its slot; `saves`: (tokens into the row, slot) where
    the state after that many of its tokens is saved too."""

    slot: int
    length: int
    first: bool
    saves: tuple[tuple[int, int], ...] = ()


@dataclass
class StepStates:
    """Which slots one forward pass's rows read and write."""

    pool: StatePool
    decode_slots: torch.Tensor | None = None       # [decode rows] int64, on the device
    decode_positions: torch.Tensor | None = None   # [decode rows]: position 0 starts from zeros
    prompts: list[PromptRow] = field(default_factory=list)

    def layer(self, index: int) -> "LayerStates | None":
        """Layer `index`'s view of the step (None: the layer keeps no state)."""
        states = self.pool.states.get(index)
        return None if states is None else LayerStates(self, states)


class LayerStates:
    """One recurrent layer's view of the step; HybridLayer calls `mix` in place of its mixer."""

    def __init__(self, step: StepStates, states: dict[str, torch.Tensor]):
        self.step, self.states = step, states

    def mix(self, mixer: RecurrentMixer, hidden: torch.Tensor) -> torch.Tensor:
        """The mixer's output for the step's tokens, hidden [1, tokens, h]; each row's state advanced."""
        step, outputs, start = self.step, [], 0
        if step.decode_slots is not None:
            slots = step.decode_slots
            start = len(slots)
            later = step.decode_positions > 0
            state = {name: torch.where(later.view(-1, *[1] * (pool.dim() - 1)), pool[slots], 0.0)
                     for name, pool in self.states.items()}
            out, state = mixer.step(hidden[0, :start, None], state)
            for name, pool in self.states.items():
                pool[slots] = state[name].float()
            outputs.append(out.transpose(0, 1))
        for row in step.prompts:
            state = {name: (pool.new_zeros(1, *pool.shape[1:]) if row.first else pool[row.slot:row.slot + 1])
                     for name, pool in self.states.items()}
            done = 0
            for end, slot in (*row.saves, (row.length, row.slot)):   # the prefill in pieces, cut where saved
                if end > done:
                    out, state = mixer.prefill(hidden[:, start + done:start + end], state)
                    outputs.append(out)
                    done = end
                for name, pool in self.states.items():
                    pool[slot] = state[name][0]
            start += row.length
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

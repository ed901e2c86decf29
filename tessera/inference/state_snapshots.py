"""Prefix caching for recurrent layers: their states saved at block ends of prompts, by block name.

An attention layer can resume a prompt after any run of cached KV blocks; a recurrent layer
(Mamba-2, Gated DeltaNet) only where its state was saved, for its state after a block is not in
the block. So with prefix caching the engine keeps a fixed number of snapshots, each every
recurrent layer's state at the end of one full block, as extra slots of the `StatePool`, named
by that block's hash-chain name (tessera.inference.kv_cache). A new request takes the longest run
of cached KV blocks whose last block has a snapshot, starts from that state and computes the rest
(vLLM caches hybrid models' Mamba states at block boundaries the same way; Megatron-Core's
MambaSlotAllocator keeps them in a budget of slots).

Which ends are saved, while a prompt is computed (its row's prefill cut there when the end falls
inside a row): the end of the prompt's last block that an identical prompt could reuse (the last
token is always computed), and the end of the cached KV blocks the request found beyond its
snapshot, where prompts that share a prefix part ways; so of several requests sharing a prefix
and differing after it, the third and later ones resume after the prefix. Snapshots go least
recently used first when a new one needs a slot, and with their block when the KV prefix cache
reuses it.

Bookkeeping only (host); the states move in tessera.inference.recurrent_state.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class StateSnapshots:
    """Which `StatePool` slots (`first_slot`.. `first_slot + count - 1`) hold the state after which block."""

    def __init__(self, first_slot: int, count: int):
        self.count = count
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))   # lowest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()   # block name -> slot, least recently used first

    def names(self) -> list[int]:
        return list(self._slot_of)

    def longest(self, names: Sequence[int]) -> tuple[int, int | None]:
        """(n, slot): the most leading blocks of a chain `names` whose last has a snapshot, and its slot
        (0, None: none has); that snapshot counts as used now."""
        for count in range(len(names), 0, -1):
            slot = self._slot_of.get(names[count - 1])
            if slot is not None:
                self._slot_of.move_to_end(names[count - 1])
                return count, slot
        return 0, None

    def reserve(self) -> int | None:
        """A slot to save a state into, the least recently used snapshot's if none is free (None: no slots)."""
        if self._free:
            return self._free.pop()
        if self._slot_of:
            return self._slot_of.popitem(last=False)[1]
        return None

    def publish(self, name: int, slot: int) -> None:
        """A reserved slot now holds the state after block `name` (given back if that state is saved already)."""
        if name in self._slot_of:
            self._free.append(slot)
        else:
            self._slot_of[name] = slot

    def forget(self, name: int) -> None:
        """Block `name` left the KV prefix cache: its snapshot can never be matched again."""
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._free.append(slot)

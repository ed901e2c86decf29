"""The paged KV cache: one preallocated pool of fixed-size blocks that requests share.

    cache = PagedKVCache.for_model(model, num_blocks=1024, block_size=16)
    blocks = cache.allocator.allocate(3)            # a request's block table grows block by block
    k_pool, v_pool = cache.pools[layer_index]       # [num_blocks * block_size, kv heads, head dim]
    latent_pool = cache.pools[mla_layer_index]      # [num_blocks * block_size, kv_lora_rank + rope dim]

A token at position p of a request lives in slot `blocks[p // block_size] * block_size +
p % block_size` of every layer's pool. Only this rank's key/value heads are stored: the KV
groups of grouped-query attention (not one copy per query head), split over
tensor-parallel ranks as the attention layer splits them. Multi-latent attention (MLA)
stores what DeepSeek's inference stores: the normed latent and the rotated positional key,
shared by all heads (512 + 64 values a token in DeepSeek-V3 against 128 heads x (192 +
128)); every rank holds all of it, and expands it into its own heads' keys and values
when attention reads the context (tessera.inference.paged_attention.LatentLayerCache).

Block 0 is never handed out: padded rows of a CUDA-graph batch write there.

Prefix caching (`BlockAllocator(prefix_caching=True)`): a block full of tokens is named
by a hash chain (its tokens and the name of the block before it), so a request whose
prompt starts with the same full blocks as an earlier one reuses them, with a reference
count per block. Freed blocks keep their contents and their name until the allocator
hands them out again, least recently freed first (vLLM's policy; Megatron's `lru`), and
tell `on_evict` the name they lose (recurrent layers' snapshots go with it:
tessera.inference.state_snapshots).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

NULL_BLOCK = 0


class BlockAllocator:
    """Hands out block ids 1..num_blocks-1, counts their users, and remembers full blocks by name."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # oldest first
        self._users = [0] * num_blocks
        self._name_of: dict[int, int] = {}      # block -> name of the full block it holds
        self._block_named: dict[int, int] = {}  # name -> block
        self.on_evict: Callable[[int], None] | None = None   # called with each name a reused block loses

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks for one user each; MemoryError when fewer are free (nothing taken then)."""
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks asked for, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            name = self._name_of.pop(block, None)
            if name is not None:
                del self._block_named[name]
                if self.on_evict is not None:
                    self.on_evict(name)
            self._users[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """One user fewer for each block; a block nobody uses becomes free (keeping its name)."""
        for block in reversed(blocks):   # a request's last blocks are the least likely to be shared again
            self._users[block] -= 1
            if self._users[block] == 0:
                self._free[block] = None

    def cached_prefix(self, tokens: Sequence[int], limit: int) -> tuple[list[int], list[int]]:
        """(blocks, their names) of the longest run of `tokens`' leading full blocks seen before
        (at most `limit`), each block with one more user."""
        blocks, names = [], []
        for name in self.block_names(tokens, limit):
            block = self._block_named.get(name)
            if block is None:
                break
            if self._users[block] == 0:
                del self._free[block]
            self._users[block] += 1
            blocks.append(block)
            names.append(name)
        return blocks, names

    def remember(self, block: int, name: int) -> None:
        """Name a block that is now full (no-op without prefix caching, or if the name is taken)."""
        if self.prefix_caching and name not in self._block_named and block not in self._name_of:
            self._block_named[name] = block
            self._name_of[block] = name

    def block_names(self, tokens: Sequence[int], limit: int, start: int = 0, parent: int | None = None
                    ) -> list[int]:
        """The hash-chain names of full blocks start..limit-1 of `tokens` (`parent`: block start-1's)."""
        if not self.prefix_caching:
            return []
        names, size = [], self.block_size
        name = parent
        for index in range(start, min(limit, len(tokens) // size)):
            name = hash((name, tuple(tokens[index * size:(index + 1) * size])))
            names.append(name)
        return names


@dataclass(frozen=True)
class LayerShape:
    """What one attention layer caches per token: `heads` keys of `key_dim` and values of `value_dim`."""

    heads: int
    key_dim: int
    value_dim: int

    @property
    def values_per_token(self) -> int:
        return self.heads * (self.key_dim + self.value_dim)

    def allocate(self, slots: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(slots, self.heads, self.key_dim, dtype=dtype, device=device),
                torch.zeros(slots, self.heads, self.value_dim, dtype=dtype, device=device))


@dataclass(frozen=True)
class LatentShape:
    """What an MLA layer caches per token: the normed latent and the rotated key shared by all heads."""

    latent_dim: int
    pos_dim: int

    @property
    def values_per_token(self) -> int:
        return self.latent_dim + self.pos_dim

    def allocate(self, slots: int, dtype: torch.dtype, device) -> torch.Tensor:
        return torch.zeros(slots, self.values_per_token, dtype=dtype, device=device)


CacheShape = LayerShape | LatentShape


def layer_shape(attention: nn.Module) -> CacheShape:
    """The cached shape of a tessera attention module (Attention: this rank's KV groups; MLA: its latent)."""
    if hasattr(attention, "kv_lora_rank"):
        return LatentShape(attention.kv_lora_rank, attention.pos_dim)
    return LayerShape(attention.num_groups, attention.head_dim, attention.head_dim)


class PagedKVCache:
    """Every layer's pools, [num_blocks * block_size, ...]: (keys, values) per head, or one latent
    pool for MLA; and their allocator."""

    def __init__(self, shapes: dict[int, CacheShape], num_blocks: int, block_size: int, *, dtype: torch.dtype,
                 device, prefix_caching: bool = False):
        self.block_size, self.num_blocks = block_size, num_blocks
        slots = num_blocks * block_size
        self.pools = {index: shape.allocate(slots, dtype, device) for index, shape in shapes.items()}
        self.allocator = BlockAllocator(num_blocks, block_size, prefix_caching=prefix_caching)

    @staticmethod
    def model_shapes(model: nn.Module) -> dict[int, CacheShape]:
        """Each attention layer's cached shape, by global layer index (a hybrid's other layers cache none)."""
        return {index: layer_shape(block.attention) for index, block in model.layers.items()
                if hasattr(block, "attention")}

    @staticmethod
    def bytes_per_block(shapes: dict[int, CacheShape], block_size: int, dtype: torch.dtype) -> int:
        width = sum(s.values_per_token for s in shapes.values())
        return width * block_size * torch.empty((), dtype=dtype).element_size()

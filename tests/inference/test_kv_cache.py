"""The block allocator: block 0 reserved, all-or-nothing allocation, reference counts, and the
prefix cache's hash chain with least-recently-freed reuse."""

import pytest
import torch

from tessera.config import ModelConfig
from tessera.inference.kv_cache import NULL_BLOCK, BlockAllocator, PagedKVCache, layer_shape
from tessera.models.attention import Attention

TOKENS = list(range(100, 112))   # three blocks of 4


def test_blocks_are_handed_out_once_and_block_0_never():
    allocator = BlockAllocator(5, 4)
    blocks = allocator.allocate(4)
    assert sorted(blocks) == [1, 2, 3, 4] and NULL_BLOCK not in blocks
    with pytest.raises(MemoryError, match="1 KV blocks asked for, 0 free"):
        allocator.allocate(1)
    allocator.free(blocks[:2])
    assert allocator.num_free == 2
    with pytest.raises(MemoryError):
        allocator.allocate(3)
    assert allocator.num_free == 2   # nothing taken by a failed allocation


def test_full_blocks_are_found_again_by_their_hash_chain():
    allocator = BlockAllocator(8, 4, prefix_caching=True)
    blocks = allocator.allocate(3)
    names = allocator.block_names(TOKENS, 3)
    for block, name in zip(blocks, names):
        allocator.remember(block, name)
    # the same first two blocks, then different tokens: two blocks reused, each with two users
    other = TOKENS[:8] + [1, 2, 3, 4]
    found, found_names = allocator.cached_prefix(other, 3)
    assert found == blocks[:2] and found_names == names[:2]
    # a different first block breaks the chain, even with the same later tokens
    assert allocator.cached_prefix([0] + TOKENS[1:], 3) == ([], [])
    # names chain: the second block's name depends on the first block
    assert allocator.block_names([0, 0, 0, 0] + TOKENS[4:8], 2)[1] != names[1]
    allocator.free(blocks)
    assert allocator.num_free == 5   # blocks[0:2] still used by the second request
    allocator.free(found)
    assert allocator.num_free == 7


def test_freed_blocks_keep_their_contents_until_reused_least_recently_freed_first():
    allocator = BlockAllocator(4, 4, prefix_caching=True)   # blocks 1..3
    blocks = allocator.allocate(3)
    for block, name in zip(blocks, allocator.block_names(TOKENS, 3)):
        allocator.remember(block, name)
    allocator.free(blocks)               # freed last block first: 3, 2, 1
    assert allocator.cached_prefix(TOKENS, 3)[0] == blocks   # all three still there
    allocator.free(blocks)
    taken = allocator.allocate(1)        # evicts the least recently freed block: the third
    assert taken == [blocks[2]]
    assert allocator.cached_prefix(TOKENS, 3)[0] == blocks[:2]


def test_without_prefix_caching_nothing_is_named():
    allocator = BlockAllocator(4, 4)
    block = allocator.allocate(1)[0]
    allocator.remember(block, 123)
    assert allocator.block_names(TOKENS, 3) == [] and allocator.cached_prefix(TOKENS, 3) == ([], [])


def test_the_cache_holds_only_the_kv_groups_of_this_rank():
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                         num_query_groups=2, seq_length=16, vocab_size=32)
    shape = layer_shape(Attention(config, 0.02))
    assert (shape.heads, shape.key_dim, shape.value_dim) == (2, 8, 8)
    cache = PagedKVCache({0: shape}, num_blocks=3, block_size=4, dtype=torch.float32, device="cpu")
    keys, values = cache.pools[0]
    assert keys.shape == values.shape == (12, 2, 8)
    assert PagedKVCache.bytes_per_block({0: shape}, 4, torch.bfloat16) == 2 * 2 * 8 * 4 * 2

"""ShardSpec: how shards are cut from, and put back into, full parameters."""

import pytest
import torch

from tessera.parallel.sharding import ShardSpec


def specs(size: int, **fields) -> list[ShardSpec]:
    return [ShardSpec(rank=rank, size=size, **fields) for rank in range(size)]


def test_fused_blocks_are_cut_piece_by_piece():
    """A rank's shard of a fused [q; k; v] weight is its piece of each block, in order."""
    full = torch.arange(12.0).view(12, 1)  # q = rows 0-5, k = 6-8, v = 9-11
    assert ShardSpec((12, 1), 0, (6, 3, 3), rank=1, size=3).shard(full).flatten().tolist() == [2, 3, 7, 10]


def test_kv_groups_fewer_than_ranks_are_replicated():
    """4 query heads, 2 KV groups, 4 ranks: ranks 0-1 hold group 0, ranks 2-3 group 1."""
    full = torch.arange(8.0).view(8, 1)  # q heads 0-3 (one row each), k groups 4-5, v groups 6-7
    shards = [s.shard(full).flatten().tolist() for s in specs(4, full_shape=(8, 1), dim=0,
                                                               segments=(4, 2, 2), splits=(4, 2, 2))]
    assert shards == [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]


@pytest.mark.parametrize("fields", [
    dict(full_shape=(12, 5), dim=0),
    dict(full_shape=(5, 12), dim=1),
    dict(full_shape=(24, 3), dim=0, segments=(8, 8, 8), splits=(4, 2, 2)),
    dict(full_shape=(24,), dim=0, segments=(16, 4, 4), splits=(4, 1, 1)),
    dict(full_shape=(7, 3)),
])
def test_unshard_inverts_shard(fields):
    full = torch.randn(fields["full_shape"])
    shards = [spec.shard(full) for spec in specs(4, **fields)]
    torch.testing.assert_close(specs(4, **fields)[0].unshard(shards), full, rtol=0, atol=0)


@pytest.mark.parametrize("fields", [
    dict(full_shape=(12, 5), dim=0),
    dict(full_shape=(24, 3), dim=0, segments=(8, 8, 8), splits=(4, 2, 2)),
    dict(full_shape=(24,), dim=0, segments=(16, 4, 4), splits=(4, 1, 1)),
    dict(full_shape=(7, 3)),
])
def test_counted_mask_counts_every_element_once(fields):
    """Summed over ranks, the counted squares of the shards are the full tensor's."""
    full = torch.randn(fields["full_shape"])
    total = torch.zeros(())
    for spec in specs(4, **fields):
        squares = spec.shard(full).square()
        mask = spec.counted_mask()
        total += squares.sum() if mask is None else (squares * mask).sum()
    torch.testing.assert_close(total, full.square().sum())


def test_uneven_split_is_an_error():
    with pytest.raises(ValueError, match="cannot cut"):
        ShardSpec((10, 2), 0, rank=0, size=4).shard(torch.zeros(10, 2))

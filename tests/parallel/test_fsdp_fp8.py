"""The tensors of --fp8-param-gather under FSDP2 (tessera/parallel/fsdp_fp8.py), in one process:
a weight shard behaves as its values for every op, and the gathered weight is only for its FP8 GEMMs.
FSDP2 training with them: tests/dist/test_fp8_param_gather.py."""

import io

import pytest
import torch

from tessera.kernels.fp8 import E4M3
from tessera.parallel.fsdp_fp8 import Fp8Shard, GatheredFp8Weight, ShardedFp8Weight


def test_a_shard_is_its_values_and_stays_a_shard_through_views_and_updates():
    values = torch.randn(4, 3)
    shard = torch.nn.Parameter(ShardedFp8Weight(values.clone(), Fp8Shard(rows=4)))
    assert type(shard * 2) is torch.Tensor and torch.equal(shard * 2, values * 2)   # arithmetic: plain
    for view in (shard.detach(), shard.data, shard.view(-1), shard.narrow(0, 0, 2), shard.new_zeros(2, 3)):
        assert isinstance(view, ShardedFp8Weight) and view.fp8 is shard.fp8   # FSDP2's views and padding
    shard.data.mul_(3)
    assert torch.equal(shard.detach().data_, values * 3)   # updated in place
    out = torch.empty(4, 3)
    torch.mul(shard.data, 2, out=out)   # out=: the plain tensor written
    assert type(out) is torch.Tensor and torch.equal(out, values * 6)
    saved = io.BytesIO()
    torch.save(shard.detach(), saved)   # checkpoints hold plain tensors
    saved.seek(0)
    assert type(torch.load(saved)) is torch.Tensor


def test_the_gathered_weight_is_read_only_by_the_fp8_gemms():
    weight = GatheredFp8Weight(torch.zeros(4, 3, dtype=E4M3), torch.ones(()), torch.float32)
    assert weight.dtype == torch.float32 and isinstance(torch.nn.Parameter(weight), GatheredFp8Weight)
    with pytest.raises(NotImplementedError, match="--fp8-param-gather with --use-torch-fsdp2"):
        weight + 1

"""What each --data-parallel-sharding-strategy and HSDP (--num-distributed-optimizer-instances)
keeps on a rank, their process groups, and their checkpoints (gloo, CPU).

Their losses and parameters against single-process training: tests/dist/test_data_parallel.py.
"""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard

from tessera.cli.args import parse_run_config
from tessera.config import ParallelConfig
from tessera.parallel.mesh import Mesh
from tessera.training.trainer import Trainer
from tests.dist.equivalence import BASE, STEPS, train
from tests.dist.launcher import run_distributed
from tests.dist.test_checkpoint import STOP, interrupted_and_uninterrupted, resume, save_at_stop

STRATEGY = "--data-parallel-sharding-strategy"
HSDP = ["--num-distributed-optimizer-instances", "2"]
INSPECTED = {   # on 4 ranks
    "optim_grads": [STRATEGY, "optim_grads"],
    "optim_grads_params": [STRATEGY, "optim_grads_params"],
    "HSDP optim_grads_params": HSDP + [STRATEGY, "optim_grads_params"],
    "HSDP optim": HSDP + [STRATEGY, "optim"],
}


def _inspect(layouts: dict[str, list[str]]) -> dict[str, dict]:
    """Train one step under each layout, noting whether the first block's weights are still gathered
    when the model's forward returns, the warnings raised, and the gradients and state left."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, flags in layouts.items():
        config, _ = parse_run_config(BASE + flags + ["--train-iters", "1"], "test", world_size=dist.get_world_size())
        trainer = Trainer(config)
        block, gathered = trainer.model.layers[0], []
        trainer.model.register_forward_hook(   # runs after FSDP2's own post-forward hooks
            lambda *_: gathered.append(not any(isinstance(p, DTensor) for p in block.parameters())))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")   # also those this process has raised before
            trainer.train()
        params = list(trainer.model.parameters())
        fsdp2 = all(isinstance(p, DTensor) for p in params)
        out[name] = {
            "gathered_after_forward": gathered,
            "warnings": [str(w.message) for w in caught],
            "elements": sum(p.numel() for p in params),   # a DTensor's numel is the whole tensor's
            "state_bytes": trainer.optimizer.state_bytes(),
            "placements": {tuple(p.placements) for p in params} if fsdp2 else None,
            "local_params": [p.to_local().shape for p in params] if fsdp2 else None,
            "first_rows": [compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]
                           for p in params] if fsdp2 else None,
            "local_grads": [p.grad.to_local().shape for p in params] if fsdp2 else None,
            "row_bound": sum(math.ceil(p.shape[0] / p.device_mesh.shape[-1]) * p[0].numel() for p in params)
            if fsdp2 else None,
        }
    return out


@pytest.fixture(scope="module")
def inspected():
    return run_distributed(_inspect, 4, INSPECTED)


def test_optim_grads_keeps_weights_gathered_from_forward_to_backward_only(inspected):
    for rank in inspected:
        micro_batches = len(rank["optim_grads"]["gathered_after_forward"])
        assert micro_batches > 1
        assert rank["optim_grads"]["gathered_after_forward"] == [True] * micro_batches
        assert rank["optim_grads_params"]["gathered_after_forward"] == [False] * micro_batches


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_gradients_and_weights_stay_sharded(inspected, strategy):
    """ZeRO-2 as ZeRO-3: after the step each rank holds 1/DP of every gradient and weight (FSDP2 pads
    dim 0 to a multiple of DP; the last ranks' shards may be shorter)."""
    for rank in inspected:
        result = rank[strategy]
        assert result["placements"] == {(Shard(0),)}
        assert result["local_grads"] == result["local_params"]
        held = sum(math.prod(shape) for shape in result["local_grads"])
        assert held <= result["row_bound"] < result["elements"] / 2


def test_hsdp_shards_over_two_ranks_and_replicates_over_two(inspected):
    fsdp2 = [rank["HSDP optim_grads_params"] for rank in inspected]
    assert all(result["placements"] == {(Replicate(), Shard(0))} for result in fsdp2)
    # Ranks 0, 1 form one replica, 2, 3 the other: rank r holds the rows rank r - 2 holds.
    assert fsdp2[0]["first_rows"] == fsdp2[2]["first_rows"] != fsdp2[1]["first_rows"] == fsdp2[3]["first_rows"]
    assert sum(math.prod(s) for r in fsdp2[:2] for s in r["local_params"]) == fsdp2[0]["elements"]
    # The partial distributed optimizer: Adam's two fp32 moments for half the weights per rank.
    for rank in inspected:
        expected = 2 * 4 * rank["HSDP optim"]["elements"] / 2
        assert abs(rank["HSDP optim"]["state_bytes"] - expected) < 0.01 * expected


def test_fsdp2_runs_raise_no_view_warning(inspected):
    """FSDP2 warned once per rank that the model returned a view tensor (the per-token losses)."""
    for rank in inspected:
        for name in ("optim_grads", "optim_grads_params", "HSDP optim_grads_params"):
            assert not [w for w in rank[name]["warnings"] if "view" in w], name


def _hsdp_groups(tp: int, cp: int, replicas: int) -> tuple[list[int] | None, list[int] | None]:
    mesh = Mesh.build(ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     use_distributed_optimizer=True, num_distributed_optimizer_instances=replicas),
                      "cpu")
    return tuple(dist.get_process_group_ranks(mesh.group(name)) for name in ("dp_cp_shard", "dp_replicate"))


def _megatron_partial_groups(world: int, tp: int, replicas: int, rank: int) -> tuple[list[int], list[int]]:
    """Megatron's intra- and inter-partial data-parallel groups (with CP) of `rank`, PP = 1: the ranks
    of one TP rank, cut into `replicas` consecutive chunks (megatron/core/parallel_state.py)."""
    dp_cp = [r for r in range(world) if r % tp == rank % tp]
    size = len(dp_cp) // replicas
    chunks = [dp_cp[i * size:(i + 1) * size] for i in range(replicas)]
    position = dp_cp.index(rank) % size
    return next(c for c in chunks if rank in c), [chunk[position] for chunk in chunks]


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)])
def test_hsdp_groups_are_megatrons_partial_data_parallel_groups(tp, cp):
    results = run_distributed(_hsdp_groups, 8, tp, cp, 2)
    for rank, (shard, replicate) in enumerate(results):
        assert (shard, replicate) == _megatron_partial_groups(8, tp, 2, rank)


# -- checkpoints ------------------------------------------------------------------------

def test_hsdp_resumes_exactly(tmp_path):
    """The partial distributed optimizer's slices are held by both replicas: saved once, loaded by both."""
    expected, resumed = run_distributed(interrupted_and_uninterrupted, 4, HSDP + [STRATEGY, "optim"],
                                        str(tmp_path))[0]
    assert len(expected) == STEPS and resumed == expected


def test_checkpoints_reshard_between_strategies(tmp_path):
    """Saved under HSDP with FSDP2 (4 ranks), loaded by the distributed optimizer (2 ranks)."""
    reference = train([])["loss"]
    before = run_distributed(save_at_stop, 4, HSDP + [STRATEGY, "optim_grads"], str(tmp_path))[-1]
    after = run_distributed(resume, 2, [STRATEGY, "optim"], str(tmp_path))[-1]
    assert len(before) == STOP and len(after) == STEPS - STOP
    torch.testing.assert_close(before + after, reference, rtol=1e-5, atol=0)

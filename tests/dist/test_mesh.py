"""The mesh puts ranks in Megatron's order: tp fastest, then cp, dp, pp."""

import torch.distributed as dist

from tessera.config import ParallelConfig
from tessera.parallel.mesh import Mesh
from tests.dist.launcher import run_distributed


def _members(tp, cp, pp, ep):
    mesh = Mesh.build(ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                     pipeline_model_parallel_size=pp, expert_model_parallel_size=ep), "cpu")
    groups = {dim: dist.get_process_group_ranks(mesh.group(dim)) if mesh.group(dim) else None
              for dim in ("tp", "cp", "dp", "pp", "dp_cp", "ep")}
    return (mesh.tp_rank, mesh.cp_rank, mesh.dp_rank, mesh.pp_rank), groups


def test_rank_order_tp2_cp2_pp2():
    results = run_distributed(_members, 8, 2, 1, 2, 1)
    for rank, (coords, groups) in enumerate(results):
        tp, cp, dp, pp = coords
        assert rank == tp + 2 * (cp + 1 * (dp + 2 * pp))
        assert groups["tp"] == [rank - tp, rank - tp + 1]
        assert groups["dp"] == [r for r in range(8) if r // 4 == pp and r % 2 == tp]
        assert groups["pp"] == [rank % 4, rank % 4 + 4]


def test_context_and_expert_groups():
    results = run_distributed(_members, 4, 1, 2, 1, 2)
    for rank, (coords, groups) in enumerate(results):
        assert groups["cp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert groups["dp"] == [rank % 2, rank % 2 + 2]
        assert groups["dp_cp"] == [0, 1, 2, 3]
        assert groups["ep"] == [rank - rank % 2, rank - rank % 2 + 1]


def _expert_groups(layouts):
    out = []
    for tp, ep, etp in layouts:
        mesh = Mesh.build(ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                         expert_tensor_parallel_size=etp), "cpu")
        out.append({dim: dist.get_process_group_ranks(mesh.group(dim)) if mesh.group(dim) else None
                    for dim in ("tp", "dp", "ep", "etp", "edp", "tp_ep")})
    return out


def test_expert_groups_fold_as_megatron_does():
    """Megatron's RankGenerator (megatron/core/parallel_state.py) on 8 ranks: TP2 DP4 with EP4 ETP1, and EP2 ETP2."""
    results = run_distributed(_expert_groups, 8, [(2, 4, 1), (2, 2, 2)])
    for rank, (folded, halves) in enumerate(results):
        assert folded["tp"] == [rank - rank % 2, rank - rank % 2 + 1] and folded["dp"] == list(range(rank % 2, 8, 2))
        assert folded["ep"] == [0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7]
        assert folded["etp"] is None and folded["edp"] == [rank % 4, rank % 4 + 4]
        assert halves["etp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert halves["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]][rank % 2 + 2 * (rank // 4)]
        assert halves["edp"] == [rank % 4, rank % 4 + 4]
        assert halves["tp_ep"] == ([0, 1, 2, 3] if rank < 4 else [4, 5, 6, 7])

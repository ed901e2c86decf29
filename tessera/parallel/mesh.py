"""The device mesh: which ranks share which process groups.

Ranks are laid out in Megatron-LM's order, tensor-parallel fastest, then context, data,
pipeline:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so that a tensor-parallel group (the chattiest) sits on neighbouring GPUs of one node.
Expert parallelism re-slices each pipeline stage's dp x cp x tp ranks as
(expert-dp, ep, expert-tp), expert-tp fastest ("MoE parallel folding", Megatron's order):

    stage rank = etp_rank + etp * (ep_rank + ep * edp_rank)

so that, for example, TP=2 DP=4 with EP=4 and expert-TP 1 puts experts on ranks 0-3 and 4-7.

With --num-distributed-optimizer-instances N (HSDP) the data-parallel ranks are cut into N
replicas of DP / N consecutive ranks, as Megatron's partial distributed optimizer cuts them
(megatron/core/parallel_state.py, the intra- and inter-partial data-parallel groups):

    dp_rank = dp_shard_rank + (DP / N) * dp_replicate_rank

The sharded state is spread over 'dp_cp_shard' (a replica's DP / N ranks x the CP ranks) and
summed over 'dp_replicate' (the N ranks with one position in their replica).

A Mesh holds torch DeviceMeshes and their groups and is passed to whatever needs them:
nothing here is global, so tests can build several meshes in one process. With one
process every size is 1 and every group is None, and the layers run unsplit.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tessera.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class Mesh:
    tp_size: int = 1
    cp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    etp_size: int = 1
    rank: int = 0
    device_mesh: DeviceMesh | None = None          # dims ("pp", "dp", "cp", "tp")
    expert_mesh: DeviceMesh | None = None          # dims ("pp", "edp", "ep", "etp")
    groups: dict = field(default_factory=dict)     # dim name -> group, for dims of size > 1
    dp_replicas: int = 1                           # --num-distributed-optimizer-instances
    # What FSDP2 shards dense weights over: the data (x context) parallel ranks, or under HSDP the
    # 2-D (dp_replicate, dp_cp_shard) mesh of FSDP2's hybrid sharding.
    fsdp_mesh: DeviceMesh | None = None
    sharding_strategy: str = "no_shard"            # --data-parallel-sharding-strategy

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size * self.pp_size

    # Coordinates of this rank.
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp_size % self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size) % self.dp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp_size * self.cp_size * self.dp_size)

    @property
    def etp_rank(self) -> int:
        return self._stage_rank % self.etp_size

    @property
    def ep_rank(self) -> int:
        return self._stage_rank // self.etp_size % self.ep_size

    @property
    def edp_rank(self) -> int:
        """Rank among the replicas of this rank's experts (expert data parallelism)."""
        return self._stage_rank // (self.etp_size * self.ep_size)

    @property
    def dp_replica_rank(self) -> int:
        """Which copy of the sharded data-parallel state this rank holds (HSDP; else 0)."""
        return self.dp_rank // (self.dp_size // self.dp_replicas)

    @property
    def dp_shard_size(self) -> int:
        """Ranks one copy of the sharded data-parallel state is spread over: DP x CP / replicas."""
        return self.dp_size * self.cp_size // self.dp_replicas

    @property
    def dp_shard_group(self):
        """The group the data-parallel state is sharded (and gradients reduce-scattered) over: 'dp_cp',
        or under HSDP one replica's 'dp_cp_shard'."""
        return self.group("dp_cp_shard" if self.dp_replicas > 1 else "dp_cp")

    @property
    def edp_size(self) -> int:
        return self.tp_size * self.cp_size * self.dp_size // (self.etp_size * self.ep_size)

    @property
    def experts_follow_data_parallel(self) -> bool:
        """Whether expert weights are replicated exactly like dense ones (no expert parallelism and
        expert-TP = TP), so that the data-parallel group also reduces and shards them."""
        return self.ep_size == 1 and self.etp_size == self.tp_size

    @property
    def _stage_rank(self) -> int:
        return self.rank % (self.tp_size * self.cp_size * self.dp_size)

    # Process groups; None where the dimension has one rank.
    def group(self, dim: str):
        """The process group of 'tp', 'cp', 'dp', 'pp', 'dp_cp' (gradient reduction), 'tp_cp' (the
        ranks sharing one micro-batch), 'tp_dp_cp' (a whole pipeline stage), 'cp_inner' and
        'cp_outer' (--hierarchical-context-parallel-sizes), 'dp_cp_shard' and 'dp_replicate' (HSDP),
        or of the experts: 'ep', 'etp', 'edp' (expert gradient reduction), 'tp_ep' (etp x ep, the
        dispatch group)."""
        return self.groups.get(dim)

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def dp_group(self):
        return self.group("dp")

    @classmethod
    def build(cls, parallel: ParallelConfig, device_type: str) -> "Mesh":
        """The mesh of the current process group (torch.distributed must be initialised)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        tp, cp, pp, ep, etp = (parallel.tensor_model_parallel_size, parallel.context_parallel_size,
                               parallel.pipeline_model_parallel_size, parallel.expert_model_parallel_size,
                               parallel.expert_tensor_size)
        dp = parallel.data_parallel_size(world)  # checks divisibility, naming the flags
        if (tp * cp * dp) % (ep * etp):
            raise ConfigError(f"--expert-model-parallel-size ({ep}) x --expert-tensor-parallel-size ({etp}) must "
                              f"divide --tensor-model-parallel-size x --context-parallel-size x data-parallel size "
                              f"({tp * cp * dp})")
        if world == 1:
            return cls(sharding_strategy=parallel.data_parallel_sharding_strategy)
        edp = tp * cp * dp // (ep * etp)
        timeout = _GroupTimeout(device_type, timedelta(minutes=parallel.distributed_timeout_minutes))
        device_mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"),
                                       **timeout.mesh(4))
        expert_mesh = init_device_mesh(device_type, (pp, edp, ep, etp), mesh_dim_names=("pp", "edp", "ep", "etp"),
                                       **timeout.mesh(4))
        # Every rank creates every group, in the same order, now: creating a group is collective.
        groups = {dim: device_mesh.get_group(dim) for dim, size in
                  (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)) if size > 1}
        flat = {name: device_mesh[dims]._flatten(name, **timeout.flat()) for name, dims in
                (("dp_cp", ("dp", "cp")), ("tp_cp", ("cp", "tp")), ("tp_dp_cp", ("dp", "cp", "tp")))
                if math.prod(device_mesh[dims].shape) > 1}
        groups.update({name: flat_mesh.get_group() for name, flat_mesh in flat.items()})
        groups.update({dim: expert_mesh.get_group(dim) for dim, size in
                       (("edp", edp), ("ep", ep), ("etp", etp)) if size > 1})
        if ep * etp > 1:
            groups["tp_ep"] = expert_mesh["ep", "etp"]._flatten("tp_ep", **timeout.flat()).get_group()
        if parallel.hierarchical_context_parallel_sizes is not None:
            groups.update(_hierarchical_cp_groups(tp, cp, dp, pp, *parallel.hierarchical_context_parallel_sizes,
                                                  timeout.timeout))
        # Context-parallel ranks hold other tokens of the same samples: FSDP2 shards over dp x cp,
        # as the gradient buffers are reduced. (The flattened mesh itself: PyTorch is deprecating
        # slicing a flattened dimension out of its root mesh.)
        fsdp_mesh = flat["dp_cp"] if cp > 1 else device_mesh["dp"]
        replicas = parallel.num_distributed_optimizer_instances
        if replicas > 1:
            # dp_rank = shard + (DP / N) x replica, and cp runs faster than dp: one replica's dp x cp
            # ranks are one dimension of the mesh.
            hsdp = init_device_mesh(device_type, (pp, replicas, dp // replicas * cp, tp),
                                    mesh_dim_names=("pp", "dp_replicate", "dp_cp_shard", "tp"), **timeout.mesh(4))
            groups.update({dim: hsdp.get_group(dim) for dim in ("dp_replicate", "dp_cp_shard")})
            fsdp_mesh = hsdp["dp_replicate", "dp_cp_shard"]
        return cls(tp, cp, dp, pp, ep, etp, dist.get_rank(), device_mesh, expert_mesh, groups, replicas, fsdp_mesh,
                   parallel.data_parallel_sharding_strategy)


def _hierarchical_cp_groups(tp: int, cp: int, dp: int, pp: int, inner: int, outer: int, timeout: timedelta
                            ) -> dict:
    """--hierarchical-context-parallel-sizes: each CP group cut into groups of `inner` neighbouring
    CP ranks ('cp_inner', a2a+p2p's all-to-all) and the `outer` ranks with one inner index
    ('cp_outer', its ring); levels of one rank are left out."""
    def rank(tp_rank: int, cp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

    others = [(t, d, p) for p in range(pp) for d in range(dp) for t in range(tp)]
    levels = {
        "cp_inner": [[rank(t, o * inner + i, d, p) for i in range(inner)] for t, d, p in others for o in range(outer)],
        "cp_outer": [[rank(t, o * inner + i, d, p) for o in range(outer)] for t, d, p in others for i in range(inner)],
    }
    groups = {}
    for name, size in (("cp_inner", inner), ("cp_outer", outer)):
        if size > 1:   # every rank creates every group, in the same order
            groups[name], _ = dist.new_subgroups_by_enumeration(levels[name], timeout=timeout)
    return groups


# DeviceMesh creates its groups with PyTorch's default timeout (30 min gloo, 10 min NCCL)
# unless each dimension gets options carrying one (pytorch/pytorch#119574); torch < 2.9 has
# no such argument, and there only the world group follows --distributed-timeout-minutes.
_MESH_TAKES_OPTIONS = "backend_override" in inspect.signature(init_device_mesh).parameters


@dataclass(frozen=True)
class _GroupTimeout:
    """Process-group options that carry --distributed-timeout-minutes, for DeviceMesh."""

    device_type: str
    timeout: timedelta

    def _options(self) -> tuple:
        if self.device_type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
        else:
            options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        return ("nccl" if self.device_type == "cuda" else "gloo"), options

    def mesh(self, ndim: int) -> dict:
        """init_device_mesh's keyword arguments for a mesh of `ndim` dimensions."""
        return {"backend_override": {dim: self._options() for dim in range(ndim)}} if _MESH_TAKES_OPTIONS else {}

    def flat(self) -> dict:
        """DeviceMesh._flatten's keyword arguments."""
        return {"backend_override": self._options()} if _MESH_TAKES_OPTIONS else {}

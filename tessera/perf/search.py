"""Choose a layout: enumerate the runnable ones, keep those that fit, rank by predicted MFU.

The candidates are the layouts a Megatron user would try: TP within a node (a power of
two dividing the heads), PP dividing the layers, context parallel only for sequences of
8k and more (each --cp-comm-type; a2a+p2p with its all-to-all inside a node), interleaving only with pipelining, each pipeline split evenly and balanced
(tessera.perf.pipeline_balance), sequence parallelism and TP comm overlap
whenever TP > 1, the distributed optimizer whenever DP > 1 (it is never slower and saves
memory), recomputation only as a fallback when nothing fits without it. For MoE models,
expert parallelism: EP a power of two dividing the experts, expert-TP 1 or the TP size,
folded into TP x CP x DP; the alltoall dispatcher with EP > 1 is tried beside allgather.
Anything a user fixes on the command line is held fixed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from tessera.config import ConfigError, ModelConfig
from tessera.perf.cluster import Cluster
from tessera.perf.kernels import KernelCurves
from tessera.perf.layout import Layout, check_layout
from tessera.perf.memory import usable_bytes
from tessera.perf.pipeline_balance import balance_pipeline
from tessera.perf.simulator import Prediction, predict

MICRO_BATCH_SIZES = (1, 2, 4, 8)
LONG_SEQUENCE = 8192


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchSpace:
    """Values to try per setting; a one-element tuple fixes a setting."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    cp_comm_type: tuple[str, ...] | None = None
    ep: tuple[int, ...] | None = None
    etp: tuple[int, ...] | None = None
    moe_dispatcher: tuple[str, ...] | None = None
    virtual_stages: tuple[int, ...] | None = None
    micro_batch_size: tuple[int, ...] | None = None
    recompute: tuple[str, ...] | None = None
    # Layers of the first/last pipeline stage: held fixed when either is given; otherwise
    # every pipeline layout is tried with the even split and, if balance_pipeline, the balanced one.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    balance_pipeline: bool = True
    # What the framework does, not searched: Megatron with Transformer Engine overlaps TP
    # communication and runs eager (the published runs); tessera compiles and overlaps what its
    # flags say.
    tp_comm_overlap: bool = True
    overlap_p2p_communication: bool = False
    compiled: bool = False
    framework: str = "megatron"
    fp8: dict | None = None   # the FP8 settings (Layout's FP8_FIELDS), held fixed; None: bf16
    moments: dict | None = None   # the Adam moments' dtypes (Layout's MOMENT_FIELDS), held fixed; None: fp32


def candidates(model: ModelConfig, gpus: int, gpus_per_node: int, global_batch_size: int, seq_length: int,
               space: SearchSpace = SearchSpace()) -> list[Layout]:
    """Every layout in the search space that check_layout accepts."""
    tps = space.tp or tuple(_powers_of_two(min(gpus_per_node, gpus)))
    pps = space.pp or tuple(d for d in _divisors(model.num_layers) if d <= gpus)
    cps = space.cp or (tuple(_powers_of_two(min(16, gpus))) if seq_length >= LONG_SEQUENCE else (1,))
    micro_batches = space.micro_batch_size or MICRO_BATCH_SIZES
    found = []
    for tp, pp, cp, mbs in itertools.product(tps, pps, cps, micro_batches):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        virtual = (space.virtual_stages or tuple(_divisors(model.num_layers // pp))) if pp > 1 else (1,)
        for vp, (ep, etp, dispatcher), (cp_kind, cp_a2a) in itertools.product(
                virtual, _expert_layouts(model, tp, space), _context_layouts(tp, cp, gpus_per_node, space)):
            first, last = space.first_stage_layers, space.last_stage_layers
            if pp > 1 and first is None and last is None:
                first, last = uneven_split(model.num_layers, pp * vp)
            layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, cp_comm_type=cp_kind, cp_a2a_size=cp_a2a,
                            ep=ep, etp=etp, moe_dispatcher=dispatcher,
                            virtual_stages=vp, micro_batch_size=mbs,
                            first_stage_layers=first if pp > 1 else None,
                            last_stage_layers=last if pp > 1 else None,
                            sequence_parallel=tp > 1, tp_comm_overlap=space.tp_comm_overlap and tp > 1,
                            overlap_p2p_communication=space.overlap_p2p_communication and pp > 1,
                            # with replicas to shard over (DP x CP or EDP > 1), or for the FP8 gather's cast
                            distributed_optimizer=dp * cp > 1 or tp * cp * dp > ep * (etp or tp)
                            or bool((space.fp8 or {}).get("fp8_param_gather")),
                            compiled=space.compiled, framework=space.framework, **(space.fp8 or {}),
                            **(space.moments or {}))
            try:
                check_layout(model, layout, global_batch_size, seq_length)
            except ConfigError:
                continue
            found.append(layout)
    return found


def uneven_split(num_layers: int, stages: int) -> tuple[int | None, int | None]:
    """(first, last) stage sizes nearest to even that let the other stages split the rest evenly
    (DeepSeek-V3's 61 layers over 16 stages: 3 and 2 around 14 of 4); (None, None) when an even
    split works. The last stage, which also runs the output layer, gets the smaller share."""
    if num_layers % stages == 0 or stages < 3:
        return None, None
    splits = []
    for middle in (num_layers // stages, num_layers // stages + 1):
        rest = num_layers - middle * (stages - 2)
        splits += [((first - middle) ** 2 + (rest - first - middle) ** 2, rest - first, first)
                   for first in range(1, rest)]
    if not splits:
        return None, None
    _, last, first = min(splits)
    return first, last


def _context_layouts(tp: int, cp: int, gpus_per_node: int, space: SearchSpace) -> list[tuple[str, int | None]]:
    """(--cp-comm-type, all-to-all group of a2a+p2p) to try; check_layout drops what the heads do not allow.
    a2a+p2p's all-to-all spans the CP ranks of one node, its ring the nodes."""
    if cp == 1:
        return [("p2p", None)]
    in_node = max(gpus_per_node // tp, 1)
    hierarchical = [("a2a+p2p", in_node)] if 1 < in_node < cp and cp % in_node == 0 else []
    tried = [("p2p", None), ("all_gather", None), ("a2a", None)] + hierarchical
    return [(kind, size) for kind, size in tried if space.cp_comm_type is None or kind in space.cp_comm_type]


def _expert_layouts(model: ModelConfig, tp: int, space: SearchSpace) -> list[tuple[int, int | None, str]]:
    """(EP, expert-TP, dispatcher) to try with this TP; check_layout drops what does not fold."""
    if model.num_experts is None:
        return [(1, None, "allgather")]
    eps = space.ep or tuple(_powers_of_two(model.num_experts))
    etps = space.etp or tuple(sorted({1, tp}))
    tried = []
    for ep, etp in itertools.product(eps, etps):
        dispatchers = space.moe_dispatcher or (("allgather", "alltoall") if ep > 1 else ("allgather",))
        tried += [(ep, etp, dispatcher) for dispatcher in dispatchers]
    return tried


def search(model: ModelConfig, gpus: int, cluster: Cluster, curves: KernelCurves, global_batch_size: int,
           seq_length: int, space: SearchSpace = SearchSpace(), causal_flops: bool = True,
           top: int = 5) -> list[Prediction]:
    """The `top` best layouts that fit in memory, best first; empty if none fits."""
    layouts = candidates(model, gpus, cluster.gpus_per_node, global_batch_size, seq_length, space)
    if space.balance_pipeline and space.first_stage_layers is None and space.last_stage_layers is None:
        balanced = (balance_pipeline(model, layout, cluster, curves, seq_length) for layout in layouts if layout.pp > 1)
        layouts += [layout for layout in balanced if layout.uneven]
    capacity = usable_bytes(cluster.gpu.memory_gb)
    for recompute in space.recompute or ("none", "selective", "full"):
        fitting = []
        for layout in layouts:
            prediction = predict(model, replace(layout, recompute=recompute), cluster, curves,
                                 global_batch_size, seq_length, causal_flops)
            if prediction.memory.total <= capacity:
                fitting.append(prediction)
        if fitting:
            return sorted(fitting, key=lambda p: p.step_time)[:top]
    return []

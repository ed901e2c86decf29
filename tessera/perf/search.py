"""Choose a layout: enumerate the runnable ones, keep those that fit, rank by predicted step time.

The candidates are the layouts a Megatron user would try: TP within a node (a power of
two dividing the heads); any number of pipeline stages that divides the GPUs, the layers
split evenly where they divide and otherwise with uneven first and last stages
(Megatron's --decoder-first/last-pipeline-num-layers), each split also balanced by the
simulator's per-layer times (tessera.perf.pipeline_balance); interleaving wherever the
stages split; context parallelism only for sequences of 8k and more (each --cp-comm-type;
a2a+p2p with its all-to-all inside a node); sequence parallelism whenever TP > 1, with
--tp-comm-overlap tried on and off; the pipeline transfers overlapped; the distributed
optimizer whenever there are replicas (it is never slower and saves memory), with the
gradient reduction and parameter gather overlapped; recomputation only as a fallback when
nothing fits without it, and offloading (optimizer state, chosen activations) when nothing fits
even with it. For MoE models, expert parallelism: EP a power of two dividing the
experts, expert-TP 1 or the TP size, folded into TP x CP x DP; the alltoall dispatcher with
EP > 1 is tried beside allgather. Anything a user fixes on the command line is held fixed,
and every candidate is one `tessera train` accepts (check_layout asks its config).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

from tessera.config import ConfigError, ModelConfig
from tessera.perf.cluster import Cluster
from tessera.perf.kernels import KernelCurves
from tessera.perf.layout import RECOMPUTE, Layout, check_layout
from tessera.perf.memory import estimate_memory, usable_bytes
from tessera.perf.pipeline_balance import balance_pipeline
from tessera.perf.simulator import Prediction, StepModel, predict

MICRO_BATCH_SIZES = (1, 2, 4, 8)
LONG_SEQUENCE = 8192
# The batch a search takes when none is given: 4,096 tokens per GPU, at least 2^20 tokens.
# NVIDIA's LLaMA-3 recipes in Megatron-LM's examples/llama/README.md use exactly this on 8, 64 and
# 1,024 H100s (128, 128 and 512 sequences of 8,192); GPT-3 175B took 1,536 of 2,048 on 1,024 GPUs
# (Narayanan et al. 2021), 3,072 tokens per GPU.
DEFAULT_TOKENS_PER_GPU, DEFAULT_MIN_BATCH_TOKENS = 4096, 2**20
DEFAULT_BATCH_RULE = "4,096 tokens per GPU, at least 2^20 tokens"


def default_global_batch_size(gpus: int, seq_length: int) -> int:
    """Sequences in the batch a search takes when none is given (DEFAULT_BATCH_RULE)."""
    return max(1, max(DEFAULT_MIN_BATCH_TOKENS, DEFAULT_TOKENS_PER_GPU * gpus) // seq_length)


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
    # Layers of the first/last pipeline stage: held fixed when either is given; otherwise each
    # pipeline layout is tried with the split nearest even (uneven_split) and, if balance_pipeline,
    # the balanced one.
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    balance_pipeline: bool = True
    # Overlaps: None searches them. --tp-comm-overlap is tried on and off wherever TP > 1 (it hides
    # the collectives but re-gathers inputs in backward, and changes what is saved); pipeline
    # transfers are overlapped wherever PP > 1 (the model charges them only time). True or False
    # holds a setting fixed (Megatron's published runs: TP overlap on, from Transformer Engine).
    tp_comm_overlap: bool | None = None
    overlap_p2p_communication: bool | None = None
    compiled: bool = False
    framework: str = "megatron"
    fp8: dict | None = None   # the FP8 settings (Layout's FP8_FIELDS), held fixed; None: bf16
    moments: dict | None = None   # the Adam moments' dtypes (Layout's MOMENT_FIELDS), held fixed; None: fp32
    # Offloading (tessera.perf.offload): None tries it once nothing fits without it; a value holds it fixed.
    optimizer_cpu_offload: bool | None = None
    offload_modules: tuple[str, ...] | None = None


def candidates(model: ModelConfig, gpus: int, gpus_per_node: int, global_batch_size: int, seq_length: int,
               space: SearchSpace = SearchSpace()) -> list[Layout]:
    """Every layout in the search space that check_layout accepts (that `tessera train` runs)."""
    tps = space.tp or tuple(_powers_of_two(min(gpus_per_node, gpus)))
    # Any stage count that divides the GPUs: uneven first/last stages take what an even split cannot.
    pps = space.pp or tuple(d for d in _divisors(gpus) if d <= model.num_layers)
    cps = space.cp or (tuple(_powers_of_two(min(16, gpus))) if seq_length >= LONG_SEQUENCE else (1,))
    micro_batches = space.micro_batch_size or MICRO_BATCH_SIZES
    found = []
    for tp, pp, cp, mbs in itertools.product(tps, pps, cps, micro_batches):
        if gpus % (tp * pp * cp):
            continue
        dp = gpus // (tp * pp * cp)
        p2p_overlap = pp > 1 and space.overlap_p2p_communication is not False
        for (vp, first, last), (ep, etp, dispatcher), (cp_kind, cp_a2a), tp_overlap in itertools.product(
                pipeline_splits(model.num_layers, pp, space), _expert_layouts(model, tp, space),
                _context_layouts(tp, cp, gpus_per_node, space), _tp_overlaps(tp, space)):
            layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, cp_comm_type=cp_kind, cp_a2a_size=cp_a2a,
                            ep=ep, etp=etp, moe_dispatcher=dispatcher,
                            virtual_stages=vp, micro_batch_size=mbs, first_stage_layers=first, last_stage_layers=last,
                            sequence_parallel=tp > 1, tp_comm_overlap=tp_overlap, overlap_p2p_communication=p2p_overlap,
                            # with replicas to shard over (DP x CP or EDP > 1), or for the FP8 gather's cast
                            distributed_optimizer=dp * cp > 1 or tp * cp * dp > ep * (etp or tp)
                            or bool((space.fp8 or {}).get("fp8_param_gather")),
                            compiled=space.compiled, framework=space.framework, **(space.fp8 or {}),
                            **(space.moments or {}))
            if _runs(model, layout, global_batch_size, seq_length):
                found.append(layout)
    return found


def _tp_overlaps(tp: int, space: SearchSpace) -> tuple[bool, ...]:
    """--tp-comm-overlap settings to try; check_layout drops what the trainer refuses (with FP8)."""
    if tp == 1:
        return (False,)
    return (False, True) if space.tp_comm_overlap is None else (space.tp_comm_overlap,)


def pipeline_splits(num_layers: int, pp: int, space: SearchSpace = SearchSpace()
                    ) -> list[tuple[int, int | None, int | None]]:
    """(virtual stages, first stage's layers, last stage's layers) to try over `pp` pipeline ranks:
    where the ranks can hold equal shares, every interleaving whose stages split the layers evenly;
    where they cannot, every interleaving with a near-even uneven split (uneven_split). A split the
    space holds fixed is tried with every interleaving (check_layout drops what does not split)."""
    if pp == 1:
        return [(1, None, None)]
    fixed = (space.first_stage_layers, space.last_stage_layers)
    splits = []
    for vp in space.virtual_stages or range(1, num_layers // pp + 1):
        if fixed != (None, None):
            split = fixed
        elif num_layers % pp:
            split = uneven_split(num_layers, pp * vp)
        else:
            split = (None, None) if num_layers % (pp * vp) == 0 else None
        if split is not None:
            splits.append((vp, *split))
    return splits


def uneven_split(num_layers: int, stages: int) -> tuple[int | None, int | None] | None:
    """--decoder-first/last-pipeline-num-layers for `stages` stages, the other stages splitting the
    rest evenly: (None, None) when all can be even; else the first and last sizes nearest even
    with no stage above the even share rounded up (DeepSeek-V3's 61 layers over 16 stages: 3 and
    2 around 14 of 4), the last, which also runs the output layer, the smaller; None when no
    such split exists (61 layers over 32 stages)."""
    if num_layers % stages == 0:
        return None, None
    ceiling = -(-num_layers // stages)
    splits = []
    for middle in {num_layers // stages, ceiling} - {0}:
        rest = num_layers - middle * (stages - 2)
        splits += [((first - middle) ** 2 + (rest - first - middle) ** 2, rest - first, first)
                   for first in range(max(1, rest - ceiling), min(rest - 1, ceiling) + 1)]
    if not splits:
        return None
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
    """The `top` best layouts that fit in memory, best first; empty if none fits. Recomputation
    is tried only when no layout fits without it, selective before full, and offloading only when
    none fits even so (memory_levers); a pipelined layout that fits is tried balanced too
    (balance_pipeline).

    Candidates are taken in order of a time no step of theirs can beat (step_time_bound), and the
    search stops at the first whose bound does not beat the `top`-th best prediction: it returns
    what predicting every candidate would, without predicting most of them.
    """
    steps = StepModel(model, cluster, curves, seq_length)
    bounded = sorted((step_time_bound(steps, layout, global_batch_size), index, layout) for index, layout in
                     enumerate(candidates(model, gpus, cluster.gpus_per_node, global_batch_size, seq_length, space)))
    balance = space.balance_pipeline and space.first_stage_layers is None and space.last_stage_layers is None
    capacity = usable_bytes(cluster.gpu.memory_gb)

    def fits(layout: Layout) -> bool:
        memory = functools.partial(estimate_memory, model, layout, global_batch_size, seq_length,
                                   layers_of=steps.layers_of)
        return memory(ranks=range(1)).total <= capacity and memory().total <= capacity

    for levers in memory_levers(model, space):
        best: list[Prediction] = []
        for bound, _, candidate in bounded:
            if len(best) == top and bound >= best[-1].step_time:
                break
            for recompute, optimizer_offload, modules in levers:
                layout = with_levers(candidate, recompute, optimizer_offload, modules)
                offloads = optimizer_offload or bool(modules)
                if offloads and not _runs(model, layout, global_batch_size, seq_length) or not fits(layout):
                    continue
                variants = [layout]
                if balance and layout.pp > 1:
                    balanced = balance_pipeline(steps, layout)
                    if balanced != layout and _runs(model, balanced, global_batch_size, seq_length) and fits(balanced):
                        variants.append(balanced)
                predictions = [predict(model, variant, cluster, curves, global_batch_size, seq_length, causal_flops,
                                       steps=steps) for variant in variants]
                best = sorted(best + predictions, key=lambda p: p.step_time)[:top]
        if best:
            return best
    return []


def memory_levers(model: ModelConfig, space: SearchSpace) -> list[list[tuple[str, bool, tuple[str, ...]]]]:
    """Rounds of (recompute, optimizer offload, offloaded modules), each tried only when nothing fit
    in the rounds before, its settings competing on predicted time: no recomputation, then
    selective, then full, all without offloading; then every combination with offloading, whose
    cost (the host link) may beat recomputation's or not (tessera.perf.offload). What the space
    holds fixed is held in every round."""
    recomputes = space.recompute or RECOMPUTE
    optimizer = (space.optimizer_cpu_offload,) if space.optimizer_cpu_offload is not None else (False,)
    modules = (space.offload_modules,) if space.offload_modules is not None else ((),)
    rounds = [[(recompute, optimizer[0], modules[0])] for recompute in recomputes]
    if space.optimizer_cpu_offload is None or space.offload_modules is None:
        offloads = [(recompute, opt, chosen) for recompute in recomputes
                    for opt in (optimizer if space.optimizer_cpu_offload is not None else (False, True))
                    for chosen in (modules if space.offload_modules is not None else
                                   ((), default_offload_modules(model, recompute)))
                    if (opt or chosen) and not (chosen and recompute == "full")]
        rounds.append([setting for setting in offloads if setting not in [r[0] for r in rounds]])
    return [levers for levers in rounds if levers]


def default_offload_modules(model: ModelConfig, recompute: str) -> tuple[str, ...]:
    """What the planner offloads: the attention's core and projection input (Megatron-LM's advice,
    docs/user-guide/features/fine_grained_activation_offloading.md), the dense MLP's, the routed
    experts'; not the core under selective recompute, which recomputes it."""
    core = () if recompute == "selective" else ("core_attn",)
    return core + ("attn_proj", "mlp") + (("expert_fc1",) if model.num_experts else ())


def with_levers(layout: Layout, recompute: str, optimizer_offload: bool, modules: tuple[str, ...]) -> Layout:
    """The layout with these memory settings: optimizer offload with the distributed optimizer (one
    GPU too), activation offload in uncompiled blocks (its hooks need module boundaries)."""
    return replace(layout, recompute=recompute, optimizer_cpu_offload=optimizer_offload, offload_modules=modules,
                   distributed_optimizer=layout.distributed_optimizer or (optimizer_offload and not layout.fsdp),
                   compiled=layout.compiled and not modules)


def step_time_bound(steps: StepModel, layout: Layout, global_batch_size: int) -> float:
    """A time the layout's step cannot beat: the micro-batches' passes through every layer and the
    output layer, no recomputation, nothing exposed but the layers' own communication, and the
    pipeline as balanced as it could be. The simulator's step is m x the slowest rank's time T plus
    the other ranks' (S - T) / v, which grows with T (m >= 1 >= 1/v), and T >= S / p: so the step
    is at least S / p x (m + (p - 1) / v), S being one micro-batch's time over all ranks."""
    micro_batches, p = layout.num_micro_batches(global_batch_size), layout.pp
    return steps.all_layers(layout) / p * (micro_batches + (p - 1) / layout.virtual_stages)


def _runs(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int) -> bool:
    try:
        check_layout(model, layout, global_batch_size, seq_length)
    except ConfigError:
        return False
    return True

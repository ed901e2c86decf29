"""`tessera plan`: predicted memory, step time and MFU; the best layouts, or one layout explained.

    tessera plan --model llama3-70b --gpus 64 --gpu h100 --global-batch-size 512 --seq-length 8192
    tessera plan --model mixtral-8x7b --gpus 64                # EP searched too; the default batch
    tessera plan --model gpt3-175b --gpus 1024 --global-batch-size 1536 --explain \\
        --tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 --sequence-parallel \\
        --num-layers-per-virtual-pipeline-stage 2 --use-distributed-optimizer
    tessera plan --published --figures docs/figures     # Megatron's H100 scaling runs
    tessera plan --production                           # Megatron's production layouts beside the planner's picks

Layout flags are `tessera train`'s; any given (on the command line or in --config) is held
fixed while the others are searched (tessera.perf.search says what is tried, overlaps
included); the best layout's flags are printed for `tessera train`. Without
--global-batch-size a search takes a default batch and says so. --explain predicts exactly
the layout given, with `tessera train`'s defaults for the rest (--expert-tensor-parallel-size
= TP, the allgather dispatcher, overlaps off).
"""

from __future__ import annotations

import argparse
import json
import sys

from tessera.cli.args import build_parser, fail, resolve
from tessera.config import SECTIONS, ConfigError, ModelConfig, ParallelConfig
from tessera.perf.cluster import CLUSTERS, lookup_cluster
from tessera.cli.flops import parameter_summary
from tessera.perf.kernels import load_curves
from tessera.perf.layout import FP8_FIELDS, MOMENT_FIELDS, Layout, check_layout
from tessera.perf.memory import GIB, usable_bytes
from tessera.perf.search import DEFAULT_BATCH_RULE, SearchSpace, default_global_batch_size, search
from tessera.perf.simulator import Prediction, predict

PROG = "tessera plan"


def _extra(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("planning")
    group.add_argument("--gpus", type=int, help="GPUs in the job (default for --explain: one data-parallel replica)")
    group.add_argument("--gpu", default="h100", help="GPU kind: h100, h200, a100 (picks the DGX cluster preset)")
    group.add_argument("--cluster", choices=sorted(CLUSTERS), help="cluster preset (overrides --gpu)")
    group.add_argument("--explain", action="store_true", help="predict the layout given by the flags, term by term")
    group.add_argument("--top", type=int, default=5, help="layouts to list")
    group.add_argument("--json", action="store_true", help="print JSON instead of tables")
    group.add_argument("--gemm-curve", metavar="JSON", help="kernel curves measured by bench/gemm.py")
    group.add_argument("--non-causal-flops", action="store_true",
                       help="count attention FLOPs without causal halving (Megatron before 2025)")
    group.add_argument("--published", action="store_true",
                       help="reproduce Megatron's published H100 weak/strong scaling and Mixtral 8x7B point, "
                            "and print the error tables")
    group.add_argument("--figures", metavar="DIR", help="with --published: write the scaling figures (PNG) here")
    group.add_argument("--production", action="store_true",
                       help="Megatron-LM's recommended production layouts (its parallelism guide) beside the "
                            "planner's own pick for each, on --gpu's cluster")


def _setting(values: dict, args: argparse.Namespace, name: str, default=None):
    """A layout setting from the config sections (preset < YAML < flags) or the planner's own flags."""
    for section in values.values():
        if name in section:
            return section[name]
    return getattr(args, name, None) or default


def _fixed_layout(values: dict, args: argparse.Namespace, model: ModelConfig) -> tuple[Layout, int]:
    """The layout the flags describe (with `tessera train`'s defaults), and the global batch size."""
    tp = _setting(values, args, "tensor_model_parallel_size", 1)
    pp = _setting(values, args, "pipeline_model_parallel_size", 1)
    cp = _setting(values, args, "context_parallel_size", 1)
    gpus = args.gpus or tp * pp * cp
    if gpus % (tp * pp * cp):
        raise ConfigError(f"--gpus ({gpus}) must be divisible by TP x PP x CP = {tp * pp * cp}")
    dp = gpus // (tp * pp * cp)
    virtual = _virtual_stages(values, args, model, pp) or 1
    mbs = _setting(values, args, "micro_batch_size", 1)
    hierarchical = _setting(values, args, "hierarchical_context_parallel_sizes")
    offload = _offload(values, args)   # tessera compiles on GPUs, but not blocks that offload activations
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, cp_comm_type=_setting(values, args, "cp_comm_type", ["p2p"])[0],
                    cp_a2a_size=hierarchical[0] if hierarchical else None,
                    ep=_setting(values, args, "expert_model_parallel_size", 1),
                    etp=_setting(values, args, "expert_tensor_parallel_size"),
                    moe_dispatcher=_setting(values, args, "moe_token_dispatcher_type", "allgather"),
                    virtual_stages=virtual, micro_batch_size=mbs,
                    first_stage_layers=_setting(values, args, "decoder_first_pipeline_num_layers"),
                    last_stage_layers=_setting(values, args, "decoder_last_pipeline_num_layers"),
                    sequence_parallel=bool(_setting(values, args, "sequence_parallel")),
                    **_sharding(values, args),
                    recompute=_setting(values, args, "recompute_granularity", "none"),
                    overlap_grad_reduce=bool(_setting(values, args, "overlap_grad_reduce")),
                    overlap_param_gather=bool(_setting(values, args, "overlap_param_gather")),
                    tp_comm_overlap=bool(_setting(values, args, "tp_comm_overlap")),
                    overlap_p2p_communication=bool(_setting(values, args, "overlap_p2p_communication")),
                    compiled=_setting(values, args, "compile") is not False and not offload["offload_modules"],
                    framework="tessera", **_fp8(values, args), **_moments(values, args), **offload)
    return layout, _setting(values, args, "global_batch_size", mbs * dp)


# The flags that choose how data parallelism shards the state (tessera.config.parallel).
SHARDING_FIELDS = ("data_parallel_sharding_strategy", "use_distributed_optimizer", "use_torch_fsdp2",
                   "use_megatron_fsdp", "torch_fsdp2_no_reshard_after_forward")


def _sharding(values: dict, args: argparse.Namespace) -> dict:
    """The distributed optimizer or FSDP2, as tessera train reads the sharding flags (a strategy,
    Megatron-FSDP, or the switches), as Layout fields. FSDP2 is priced as ZeRO-3 for both of its
    strategies."""
    given = {name: _setting(values, args, name) for name in SHARDING_FIELDS}
    parallel = ParallelConfig(**{name: value for name, value in given.items() if value is not None})
    return dict(distributed_optimizer=parallel.use_distributed_optimizer, fsdp=parallel.use_torch_fsdp2)


def _fp8(values: dict, args: argparse.Namespace) -> dict:
    """tessera train's FP8 flags as given (its defaults otherwise), as Layout fields."""
    return {name: _setting(values, args, name, getattr(Layout, name)) for name in FP8_FIELDS}


def _moments(values: dict, args: argparse.Namespace) -> dict:
    """tessera train's --exp-avg-dtype / --exp-avg-sq-dtype as given (fp32 otherwise), as Layout fields."""
    return {name: _setting(values, args, name, getattr(Layout, name)) for name in MOMENT_FIELDS}


def _offload(values: dict, args: argparse.Namespace) -> dict:
    """tessera train's offloading flags as given, as Layout fields."""
    activations = _setting(values, args, "fine_grained_activation_offloading")
    modules = _setting(values, args, "offload_modules") if activations else None
    return dict(optimizer_cpu_offload=bool(_setting(values, args, "optimizer_cpu_offload")),
                optimizer_offload_fraction=_setting(values, args, "optimizer_offload_fraction", 1.0),
                offload_modules=tuple(modules or ()))


def _virtual_stages(values: dict, args: argparse.Namespace, model: ModelConfig, pp: int) -> int | None:
    per_chunk = _setting(values, args, "num_layers_per_virtual_pipeline_stage")
    if not per_chunk:
        return _setting(values, args, "virtual_pipeline_model_parallel_size")
    per_rank = model.num_layers // pp
    if per_rank % per_chunk:
        raise ConfigError(f"--num-layers-per-virtual-pipeline-stage ({per_chunk}) must divide the "
                          f"{per_rank} layers of each pipeline stage")
    return per_rank // per_chunk


def _space(values: dict, args: argparse.Namespace, model: ModelConfig) -> SearchSpace:
    """Hold fixed whatever layout flag was given."""
    def given(name: str):
        value = _setting(values, args, name)
        return (value,) if value else None

    pp = _setting(values, args, "pipeline_model_parallel_size")
    virtual = _virtual_stages(values, args, model, pp) if pp else None
    return SearchSpace(tp=given("tensor_model_parallel_size"), pp=given("pipeline_model_parallel_size"),
                       cp=given("context_parallel_size"), ep=given("expert_model_parallel_size"),
                       cp_comm_type=tuple(_setting(values, args, "cp_comm_type") or ()) or None,
                       etp=given("expert_tensor_parallel_size"), moe_dispatcher=given("moe_token_dispatcher_type"),
                       virtual_stages=(virtual,) if virtual else None,
                       micro_batch_size=given("micro_batch_size"), recompute=given("recompute_granularity"),
                       first_stage_layers=_setting(values, args, "decoder_first_pipeline_num_layers"),
                       last_stage_layers=_setting(values, args, "decoder_last_pipeline_num_layers"),
                       # tessera's own runs: compiled blocks; an overlap given is held on, else searched
                       tp_comm_overlap=True if _setting(values, args, "tp_comm_overlap") else None,
                       overlap_p2p_communication=True if _setting(values, args, "overlap_p2p_communication") else None,
                       compiled=_setting(values, args, "compile") is not False, framework="tessera",
                       fp8=_fp8(values, args), moments=_moments(values, args),
                       # offloading given is held fixed; else tried once nothing fits without it
                       optimizer_cpu_offload=True if _setting(values, args, "optimizer_cpu_offload") else None,
                       offload_modules=_offload(values, args)["offload_modules"] or None)


def as_dict(prediction: Prediction, model: ModelConfig, capacity: float) -> dict:
    layout = prediction.layout
    return {
        "layout": {**layout.__dict__, "flags": layout.flags(moe=model.num_experts is not None),
                   "describe": layout.describe()},
        "mfu": prediction.mfu, "tflops_per_gpu": prediction.tflops_per_gpu, "step_time_s": prediction.step_time,
        "tokens_per_sec": prediction.tokens_per_sec, "memory_gb_per_gpu": prediction.memory.total / 1e9,
        "memory_gib_per_gpu": prediction.memory.total / GIB, "fits": prediction.memory.total <= capacity,
        "memory_gib": {k: v / GIB for k, v in prediction.memory.as_dict().items()},
        "expert_state_gib": prediction.memory.expert_state / GIB,
        "host_gib": prediction.memory.host / GIB,
        "time_s": dict(prediction.breakdown),
    }


def _precision(layout: Layout, model: ModelConfig) -> str:
    """What runs in FP8, for the table's header."""
    if layout.fp8_format is None:
        return "precision: bf16"
    fp8 = sum(layout.fp8_layers(model.num_layers))
    wgrad = ", weight gradients in bf16" if layout.no_fp8_wgrad else ""
    experts = " (and their experts, scaled per row)" if layout.fp8_experts and model.num_experts else ""
    gather = ", their weights all-gathered in E4M3" if layout.fp8_param_gather else ""
    return (f"precision: FP8 {layout.fp8_format} {layout.fp8_recipe} GEMMs in the linears of {fp8} of "
            f"{model.num_layers} layers{experts}{wgrad}{gather}; attention, norms, the rest of the layers and the "
            f"output layer in bf16")


def _print_breakdown(prediction: Prediction, capacity: float) -> None:
    memory, step = prediction.memory, prediction.step_time
    fits = "fits" if memory.total <= capacity else "DOES NOT FIT"
    print(f"\n{prediction.layout.describe()}: memory per GPU ({memory.stage}), "
          f"{memory.total / GIB:.1f} GiB of {capacity / GIB:.1f} usable: {fits}")
    for name, value in memory.as_dict().items():
        print(f"  {name:<12} {value / GIB:8.2f} GiB")
    if memory.expert_state:
        print(f"  (of weights, gradients and optimizer, routed experts {memory.expert_state / GIB:.2f} GiB)")
    if memory.host:
        print(f"  (in host memory besides: offloaded optimizer state {memory.host / GIB:.2f} GiB)")
    print(f"time per iteration {step:.3f} s (slowest stage):")
    for name, value in sorted(prediction.breakdown.items(), key=lambda item: -item[1]):
        print(f"  {name:<12} {value:8.3f} s  {value / step * 100:5.1f}%")
    print(f"  => {prediction.tflops_per_gpu:.0f} TFLOP/s/GPU, MFU {prediction.mfu * 100:.1f}%, "
          f"{prediction.tokens_per_sec:,.0f} tokens/s")


def _published(args: argparse.Namespace) -> int:
    from tessera.perf.published import (MIXTRAL_TFLOPS, STRONG_SCALING, WEAK_SCALING, error_table, predict_mixtral,
                                        reproduce)

    curves = load_curves(args.gemm_curve, gpu_name="H100")
    weak, strong = reproduce(WEAK_SCALING, curves), reproduce(STRONG_SCALING, curves)
    print(f"kernel curves: {curves.source}\n\nWeak scaling (H100, seq 4096, DP 48)\n{error_table(weak)}")
    print(f"\nStrong scaling (177B, batch 1152)\n{error_table(strong)}")
    mixtral = predict_mixtral(curves)
    print(f"\nMixtral 8x7B, 64 H100, {mixtral.layout.describe()}: published {MIXTRAL_TFLOPS:.0f} TFLOP/s/GPU, "
          f"predicted {mixtral.tflops_per_gpu:.0f} ({mixtral.tflops_per_gpu / MIXTRAL_TFLOPS - 1:+.1%}), "
          f"{mixtral.memory.total / GIB:.1f} GiB/GPU")
    if args.figures:
        from tessera.perf.figures import scaling_figure

        for path in (scaling_figure(weak, "Weak scaling, Megatron-Core H100 runs: predicted / published MFU",
                                    f"{args.figures}/weak_scaling.png", "model"),
                     scaling_figure(strong, "Strong scaling, 177B GPT-3, batch 1152: predicted MFU",
                                    f"{args.figures}/strong_scaling.png", "mfu")):
            print(f"wrote {path}")
    return 0


def _production(args: argparse.Namespace) -> int:
    from tessera.perf.production import PRODUCTION_LAYOUTS, compare, comparison_table

    cluster = lookup_cluster(args.cluster, args.gpu)
    curves = load_curves(args.gemm_curve, gpu_name=cluster.gpu.name)
    space = SearchSpace(compiled=True, framework="tessera")   # what a search without layout flags tries
    print(f"{cluster.name}; kernel curves: {curves.source}; bf16; tessera's trainer (compiled blocks)\n")
    print(comparison_table([compare(row, cluster, curves, space) for row in PRODUCTION_LAYOUTS]))
    return 0


def main(argv: list[str]) -> int:
    parser = build_parser(PROG, SECTIONS, "Predict memory, step time and MFU; choose the parallel layout.", _extra)
    args = parser.parse_args(argv)
    if args.published:
        return _published(args)
    if args.production:
        try:
            return _production(args)
        except (ConfigError, ValueError) as exc:
            fail(PROG, str(exc))
    try:
        values = resolve(args, SECTIONS)
        model = ModelConfig(**values["model"])
        cluster = lookup_cluster(args.cluster, args.gpu)
        curves = load_curves(args.gemm_curve, gpu_name=cluster.gpu.name)
        capacity = usable_bytes(cluster.gpu.memory_gb)
        causal = not args.non_causal_flops
        if args.explain:
            layout, batch = _fixed_layout(values, args, model)
            check_layout(model, layout, batch, model.seq_length)
            results = [predict(model, layout, cluster, curves, batch, model.seq_length, causal)]
        else:
            if not args.gpus:
                raise ConfigError("--gpus is required to search (or give --explain with a layout)")
            batch = _setting(values, args, "global_batch_size")
            if batch is None:
                batch = default_global_batch_size(args.gpus, model.seq_length)
                print(f"global batch {batch} sequences of {model.seq_length}: a default ({DEFAULT_BATCH_RULE}); "
                      f"set it with --global-batch-size", file=sys.stderr if args.json else sys.stdout)
            results = search(model, args.gpus, cluster, curves, batch, model.seq_length,
                             _space(values, args, model), causal, args.top)
            if not results:
                raise ConfigError(f"no layout fits {cluster.gpu.memory_gb} GiB per GPU, even with full recompute")
    except (ConfigError, ValueError) as exc:
        fail(PROG, str(exc))
    if args.json:
        print(json.dumps([as_dict(p, model, capacity) for p in results], indent=1))
        return 0
    print(f"{parameter_summary(model)}; global batch {batch} x seq {model.seq_length}")
    print(f"{cluster.name}; kernel curves: {curves.source}")
    print(_precision(results[0].layout, model))
    width = max(38, *(len(p.layout.describe()) for p in results))
    print(f"{'layout':<{width}} {'MFU':>6} {'TFLOP/s':>8} {'step s':>8} {'tokens/s':>11} {'GiB/GPU':>8}")
    for p in results:
        print(f"{p.layout.describe():<{width}} {p.mfu * 100:5.1f}% {p.tflops_per_gpu:8.0f} {p.step_time:8.3f} "
              f"{p.tokens_per_sec:11,.0f} {p.memory.total / GIB:8.1f}")
    _print_breakdown(results[0], capacity)
    if not args.explain:
        flags = results[0].layout.flags(moe=model.num_experts is not None)
        print("\ntrain with: " + " ".join(flags + ["--global-batch-size", str(batch)]))
    return 0

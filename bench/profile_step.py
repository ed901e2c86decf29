"""Where one training step's GPU time goes: torch.profiler over a few steps of config A, B, M or C.

    python bench/profile_step.py --config B [--steps 3] [--out trace_dir] [-- extra tessera flags]

Prints the top CUDA kernels, a breakdown by kind (GEMM, attention, optimizer,
elementwise/reduction, copies) as a fraction of the step, and how much of the step the GPU
has no kernel running, with the longest such gaps; all over the steps after two lead-in steps
(counted_kernels says why). Host activity is recorded only with --out (it slows the host and
so widens the gaps); then the trace is written there and the host's side of the gaps is
printed: for each long gap, how late the host launched the kernel after it and the Python code
it was running, and which code launches the kernels that find the GPU already idle.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import COMMON, CONFIGS  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

KINDS = [  # (kind, substrings of the kernel name), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("gather/scatter (MoE permutation)", ("index", "gather", "scatter", "sort", "radix")),
    # PyTorch's copies (direct_copy_kernel_cuda, ...), not Inductor's fused kernels named after a `_to_copy`
    ("copy", ("memcpy", "memset", "copy_kernel")),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lowered for k in keys)), "elementwise/other")


LEAD_IN = 2   # profiled steps left out of the counts (below)
MARKER = "spin_kernel"   # torch.cuda._sleep's kernel, launched between the lead-in and the counted steps


def counted_kernels(prof) -> list:
    """The device events after the marker kernel. The profile starts from a synchronised GPU, so
    that the host's first steps find its queue empty and launch into an idle GPU; in training
    the host runs ~100 ms ahead (bench/host_lead.py: config A, 2026-12-04), so those gaps are
    the profile's own. Gaps at a step's start that remain come from the profiler's work at every
    launch, which slows the host."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.is_user_annotation),   # an annotation (Optimizer.step#...) spans kernels
                     key=lambda e: e.time_range.start)
    marker = next(e for e in kernels if MARKER in e.name)
    return [e for e in kernels if e.time_range.start >= marker.time_range.end]


def print_gaps(kernels: list, steps: int, longest: int = 8) -> None:
    """GPU time with no kernel running, from the kernels' intervals, and the longest gaps."""
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in kernels]
    if not kernels:
        return
    gaps, busy_until, before = [], kernels[0][0], kernels[0][2]
    for start, end, name in kernels:
        if start > busy_until:
            gaps.append((start - busy_until, before, name))
        if end > busy_until:
            busy_until, before = end, name
    idle = sum(gap for gap, _, _ in gaps)
    span = busy_until - kernels[0][0]
    print(f"GPU idle: {idle / steps / 1e3:.2f} ms per step of {span / steps / 1e3:.1f} ({idle / span:.1%}), "
          f"{len(gaps) // steps} gaps a step; the longest:")
    for gap, before, after in sorted(gaps, reverse=True)[:longest]:
        print(f"  {gap / 1e3:7.3f} ms  after {before[:60]}  before {after[:60]}")


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def print_host_view(trace: Path, steps: int, longest: int = 8, min_gap_us: float = 20.0) -> None:
    """From a Chrome trace with host activity and Python stacks: where the GPU waited for the host.

    A kernel that starts less than a few microseconds after its launch call found the GPU idle;
    the Python frames around that launch are the code the GPU waited for."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    frames = defaultdict(list)   # host thread -> Python frames, by start time
    for e in events:
        if e.get("cat") == "python_function":
            frames[e["tid"]].append(e)
    for stack in frames.values():
        stack.sort(key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    marker = next(k for k in kernels if MARKER in k["name"])
    kernels = [k for k in kernels if k["ts"] >= marker["ts"] + marker["dur"]]   # as counted_kernels

    def code_at(launch: dict) -> str:
        """The innermost frames of tessera's (or a kernel library's) code around a launch."""
        t = launch["ts"]
        around = [f for f in frames[launch["tid"]] if f["ts"] <= t <= f["ts"] + f["dur"]]
        ours = [f["name"] for f in around if any(k in f["name"] for k in ("tessera/", "quack/", "bench/"))]
        return " < ".join(name.split("/")[-1] for name in reversed(ours[-3:])) or (around[-1]["name"] if around
                                                                                   else "?")

    late_gap, late_count = Counter(), Counter()
    gaps, busy_until = [], kernels[0]["ts"] if kernels else 0
    for kernel in kernels:
        gap = kernel["ts"] - busy_until
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if gap > 0 and launch is not None:
            gaps.append((gap, kernel, launch))
            if kernel["ts"] - (launch["ts"] + launch["dur"]) < min_gap_us:   # the launch came after the GPU ran dry
                where = code_at(launch)
                late_gap[where] += gap
                late_count[where] += 1
        busy_until = max(busy_until, kernel["ts"] + kernel["dur"])
    print(f"host view: {sum(late_count.values()) // steps} kernels a step found the GPU idle; "
          f"the code that launched them (idle ms a step, launches a step):")
    for where, gap in late_gap.most_common(12):
        print(f"  {gap / steps / 1e3:7.3f} ms  x{late_count[where] // steps:<5d} {where[:150]}")
    print("the longest gaps, with the host's code at the launch that ended each:")
    for gap, kernel, launch in sorted(gaps, key=lambda g: -g[0])[:longest]:
        print(f"  {gap / 1e3:7.3f} ms  before {kernel['name'][:50]}  <- {code_at(launch)[:150]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=sorted(CONFIGS), default="B")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="how many kernels to list")
    parser.add_argument("--out")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    flags = COMMON + CONFIGS[args.config] + ["--train-iters", "100"] + args.extra
    config, _ = parse_run_config(flags, "bench/profile_step.py")
    trainer = Trainer(config)
    for _ in range(args.warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.out else [])
    with profile(activities=activities, with_stack=bool(args.out)) as prof:
        for _ in range(LEAD_IN):
            trainer.train_step()
        torch.cuda._sleep(1)
        for _ in range(args.steps):
            trainer.train_step()
        torch.cuda.synchronize()
    kernels = counted_kernels(prof)
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.elapsed_us())
    by_kind: dict[str, float] = defaultdict(float)
    for name, times in by_name.items():
        by_kind[kind_of(name)] += sum(times)
    total = sum(by_kind.values())
    print(f"GPU time per step: {total / args.steps / 1e3:.1f} ms (kernels only)")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<20} {us / args.steps / 1e3:8.1f} ms  {us / total * 100:5.1f}%")
    print("top kernels:")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"  {sum(times) / args.steps / 1e3:8.2f} ms  x{len(times) // args.steps:<5d} {name[:110]}")
    print_gaps(kernels, args.steps)
    if args.out:
        trace = Path(args.out) / f"trace_{args.config}.json"
        prof.export_chrome_trace(str(trace))
        print_host_view(trace, args.steps)


if __name__ == "__main__":
    main()

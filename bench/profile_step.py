"""Where one training step's GPU time goes: torch.profiler over a few steps of config A, B, M or C.

    python bench/profile_step.py --config B [--steps 3] [--out trace_dir] [-- extra tessera flags]

Prints the top CUDA kernels, a breakdown by kind (GEMM, attention, optimizer,
elementwise/reduction, copies) as a fraction of the step, and how much of the step the GPU
has no kernel running, with the longest such gaps (where it waits for the host). Host
activity is recorded only with --out (it slows the host and so widens the gaps).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
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


def print_gaps(prof, steps: int, longest: int = 8) -> None:
    """GPU time with no kernel running, from the kernels' intervals, and the longest gaps."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
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
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            trainer.train_step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = defaultdict(float)
    for e in events:
        by_kind[kind_of(e.key)] += e.device_time_total
    total = sum(by_kind.values())
    print(f"GPU time per step: {total / args.steps / 1e3:.1f} ms (kernels only)")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<20} {us / args.steps / 1e3:8.1f} ms  {us / total * 100:5.1f}%")
    print("top kernels:")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:args.top]:
        print(f"  {e.device_time_total / args.steps / 1e3:8.2f} ms  x{e.count // args.steps:<5d} {e.key[:110]}")
    print_gaps(prof, args.steps)
    if args.out:
        prof.export_chrome_trace(str(Path(args.out) / f"trace_{args.config}.json"))


if __name__ == "__main__":
    main()

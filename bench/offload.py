"""The largest LLaMA-style model one GPU trains at micro-batch 1 x 4096, without and with offload.

    python bench/offload.py --out offload.json           # the whole ladder, one H200 (about 30 minutes)
    python bench/offload.py --link                       # only the host link's rates
    python bench/offload.py --layers 32 --settings optimizer+activations --steps 3   # one point

LLaMA-3-8B's shape (4096 wide, 32 heads / 8 KV groups, SwiGLU 14336, vocab 128256) with 8, 12,
..., 32 layers, bf16 with the distributed optimizer (fp32 masters apart from the weights), AdamW,
micro-batch 1 x 4096, --global-batch-size 16 (16 micro-batches a step), under three settings:

    none                    nothing offloaded
    optimizer               --optimizer-cpu-offload (masters and moments in host memory)
    optimizer+activations   that and --fine-grained-activation-offloading --offload-modules
                            core_attn attn_proj mlp (the blocks uncompiled)

Each point runs bench/train_mfu.py's measurement in a process of its own (an out-of-memory error
ends that point only) and the ladder of a setting stops at its first failure. Each row gives
tokens/s, TFLOP/s, MFU and peak memory beside `tessera plan --explain`'s prediction of the same
flags, and the host link's measured rates (pinned copies up, down, and both at once) beside the
one tessera.perf.offload assumes. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "none": [],
    "optimizer": ["--optimizer-cpu-offload"],
    "optimizer+activations": ["--optimizer-cpu-offload", "--fine-grained-activation-offloading", "--offload-modules",
                              "core_attn", "attn_proj", "mlp"],
}
SHAPE = ["--model", "llama3-8b", "--micro-batch-size", "1", "--seq-length", "4096", "--use-distributed-optimizer"]


def link_rates(gib: float = 2.0, repeats: int = 5) -> dict:
    """GB/s of pinned host <-> device copies: up, down, and both at once on two streams."""
    n = int(gib * 2**30)
    host_up, host_down = torch.empty(n, dtype=torch.uint8, pin_memory=True), torch.empty(n, dtype=torch.uint8,
                                                                                          pin_memory=True)
    device_up, device_down = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.ones(n, dtype=torch.uint8,
                                                                                           device="cuda")
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(up: bool, down: bool) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            if up:
                with torch.cuda.stream(streams[0]):
                    device_up.copy_(host_up, non_blocking=True)
            if down:
                with torch.cuda.stream(streams[1]):
                    host_down.copy_(device_down, non_blocking=True)
        torch.cuda.synchronize()
        return repeats * n * (up + down) / (time.perf_counter() - start) / 1e9

    timed(True, True)   # warm-up
    return {"up_gb_per_s": timed(True, False), "down_gb_per_s": timed(False, True),
            "both_gb_per_s": timed(True, True)}


def measure(layers: int, setting: str, args: argparse.Namespace) -> dict | None:
    """bench/train_mfu.py's measurement of one point, in a process of its own; None if it fails."""
    flags = SHAPE + ["--num-layers", str(layers), "--global-batch-size", str(args.global_batch_size)]
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "result.json"
        command = [sys.executable, str(ROOT / "bench" / "train_mfu.py"), "--config", "L8", "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--out", str(out), "--", *flags, *SETTINGS[setting]]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode or not out.exists():
            print(f"{layers} layers, {setting}: failed ({(done.stderr.strip().splitlines() or ['?'])[-1]})")
            return None
        return json.loads(out.read_text())


def predicted(layers: int, setting: str, args: argparse.Namespace) -> dict:
    """`tessera plan --explain --json` of the same flags on an H200."""
    command = [sys.executable, "-m", "tessera", "plan", "--explain", "--json", "--gpu", "h200", *SHAPE,
               "--num-layers", str(layers), "--global-batch-size", str(args.global_batch_size), "--bf16",
               *SETTINGS[setting]]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", action="store_true", help="measure only the host link")
    parser.add_argument("--layers", type=int, nargs="+", default=list(range(8, 33, 4)))
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    result = {"link": link_rates(), "points": []}
    print(f"host link: {json.dumps(result['link'])}")
    if not args.link:
        print(f"{'setting':<22} {'layers':>6} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} | plan: {'tokens/s':>9} "
              f"{'MFU':>6} {'GiB':>6}")
        for setting in args.settings:
            for layers in args.layers:
                measured = measure(layers, setting, args)
                if measured is None:
                    break
                plan = predicted(layers, setting, args)
                result["points"].append({"setting": setting, "layers": layers, "measured": measured, "plan": plan})
                print(f"{setting:<22} {layers:>6} {measured['tokens_per_sec']:>9,.0f} {measured['mfu'] * 100:5.1f}% "
                      f"{measured['peak_reserved_gib']:>9.1f} | plan: {plan['tokens_per_sec']:>9,.0f} "
                      f"{plan['mfu'] * 100:5.1f}% {plan['memory_gib_per_gpu']:>6.1f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

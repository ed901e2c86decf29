"""Weak and strong scaling ladders on one 8-GPU host, each point beside `tessera plan`'s prediction.

    python bench/scaling.py --ladder weak|strong|moe --out DIR [--gpus 1 2 4 8] [--dry-run] [-- FP8 flags]
    python bench/scaling.py --figures DIR        # draw DIR/weak.png and DIR/strong.png from its JSON

Every point takes the planner's best layout for its model, global batch and GPU count on a DGX H200
(tessera.perf.search, tessera's compiled trainer) and runs it with torchrun over bench/train_mfu.py
(mock data, sequence 2048, 10 warm-up and 20 timed steps): tokens/s, TFLOP/s per GPU, MFU on the
bf16 peak and peak memory go into DIR/<ladder>.json beside the prediction, with the command. The
ladders follow Megatron's figures: weak scaling grows the GPT-3 model with the GPUs (global batch 16
sequences a GPU), strong scaling keeps GPT-3 6.7B at a global batch of 128 sequences; `moe` is config
M (bench/train_mfu.py) at expert parallelism over all GPUs. Flags after `--` (FP8's) go to every run
and into the plan. --dry-run writes the plan and the commands without running them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import COMMON, CONFIGS  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.perf.cluster import CLUSTERS  # noqa: E402
from tessera.perf.kernels import load_curves  # noqa: E402
from tessera.perf.layout import FP8_FIELDS  # noqa: E402
from tessera.perf.search import SearchSpace, search  # noqa: E402

SEQ = 2048
TRAIN_MFU = Path(__file__).resolve().parent / "train_mfu.py"
# Ladder -> (GPUs, train_mfu config, model flags, global batch) per point, for the GPU counts asked.
LADDERS = {
    "weak": lambda gpus: [(n, "A", ["--model", model], 16 * n) for n, model in
                          ((1, "gpt3-1.3b"), (2, "gpt3-2.7b"), (4, "gpt3-6.7b"), (8, "gpt3-13b")) if n in gpus],
    "strong": lambda gpus: [(n, "A", ["--model", "gpt3-6.7b"], 128) for n in gpus],
    "moe": lambda gpus: [(n, "M", [], 4 * n) for n in gpus if n > 1],
}


def plan_point(gpus: int, config: str, model_flags: list[str], global_batch: int, extra: list[str]) -> dict:
    """The planner's best layout and its prediction for one point; the train_mfu.py command that runs it."""
    flags = train_mfu_flags(config) + model_flags + ["--global-batch-size", str(global_batch)] + extra
    run, _ = parse_run_config(flags, "bench/scaling.py", world_size=gpus)
    train = run.train
    space = SearchSpace(framework="tessera", compiled=True, tp_comm_overlap=not train.fp8_format,  # FP8 refuses it
                        fp8={name: getattr(train, name) for name in FP8_FIELDS} if train.fp8_format else None,
                        ep=(gpus,) if run.model.num_experts else None)   # MoE: EP over every GPU
    best = search(run.model, gpus, CLUSTERS["dgx-h200"], load_curves(gpu_name="H200"), global_batch, SEQ, space, top=1)
    if not best:
        raise SystemExit(f"bench/scaling.py: no layout of {' '.join(model_flags)} fits {gpus} GPUs")
    prediction = best[0]
    layout = prediction.layout.flags(moe=bool(run.model.num_experts))
    command = ["torchrun", "--nproc-per-node", str(gpus), str(TRAIN_MFU), "--config", config, "--",
               *model_flags, "--global-batch-size", str(global_batch), *layout, *extra]
    return {"gpus": gpus, "model": model_flags[1] if model_flags else f"config {config}",
            "global_batch_size": global_batch, "command": command,
            "predicted": {"mfu": prediction.mfu, "tflops_per_gpu": prediction.tflops_per_gpu,
                          "tokens_per_sec_per_gpu": prediction.tokens_per_sec / gpus,
                          "ms_per_step": prediction.step_time * 1e3, "memory_gib": prediction.memory.total / 2**30,
                          "layout": layout},
            "measured": None}


def train_mfu_flags(config: str) -> list[str]:
    """What bench/train_mfu.py runs for `config` before the flags given after its `--`."""
    return COMMON + CONFIGS[config] + ["--train-iters", "1"]


def measure(command: list[str]) -> dict:
    """Run a train_mfu.py command (torchrun or not); its JSON result."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        at = command.index("--")
        subprocess.run(command[:at] + ["--out", str(out)] + command[at:], check=True,
                       env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
        return json.loads(out.read_text())


def write_json(target: Path, payload: dict) -> None:
    """Under a temporary name, then renamed: a run cut short leaves the last complete file."""
    partial = target.with_suffix(".json.tmp")
    partial.write_text(json.dumps(payload, indent=1))
    partial.replace(target)


def draw(directory: Path) -> list[Path]:
    from tessera.perf.figures import measured_scaling_figure

    drawn = []
    for ladder, title, labels in (("weak", "Weak scaling on one H200 host (GPT-3 family, batch 16 a GPU)", "model"),
                                  ("strong", "Strong scaling on one H200 host (GPT-3 6.7B, batch 128)", "mfu")):
        source = directory / f"{ladder}.json"
        if source.exists():
            drawn.append(measured_scaling_figure(json.loads(source.read_text())["points"],
                                                 f"{title}: measured / predicted MFU", directory / f"{ladder}.png",
                                                 labels))
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ladder", choices=sorted(LADDERS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out", type=Path, help="directory for <ladder>.json")
    parser.add_argument("--dry-run", action="store_true", help="plan and write the commands; run nothing")
    parser.add_argument("--figures", type=Path, metavar="DIR", help="draw the figures from DIR's JSON and stop")
    parser.add_argument("extra", nargs="*", help="tessera flags for every run (after --)")
    args = parser.parse_args()
    if args.figures:
        for path in draw(args.figures):
            print(path)
        return
    if not (args.ladder and args.out):
        parser.error("--ladder and --out are needed (or --figures DIR)")
    points = [plan_point(*point, args.extra) for point in LADDERS[args.ladder](args.gpus)]
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / f"{args.ladder}.json"
    for point in points:
        print(" ".join(point["command"]), flush=True)
        if not args.dry_run:
            point["measured"] = measure(point["command"])
        # After every point: a ladder cut short keeps what it measured.
        write_json(target, {"ladder": args.ladder, "extra": args.extra, "points": points})


if __name__ == "__main__":
    main()

"""Runs on two GPUs of one host, each beside `tessera plan --explain`'s prediction of its layout.

    python bench/two_gpus.py --out DIR [--only NAME ...] [--budget-s 540] [--dry-run]

Runs (bench/train_mfu.py's configs, torchrun over 2 GPUs): config A with DP=2 and both
data-parallel overlaps; TP=2 + SP without and with --tp-comm-overlap; PP=2 interleaved with
overlapped transfers; config B with CP=2 at 32k and 64k tokens for each --cp-comm-type; config M
with EP=2 for each dispatcher; config B in FP8 at DP=2 with and without --fp8-param-gather.
DIR/two_gpus.json holds every run's command, the planner's prediction (DGX H200) and, once run,
train_mfu.py's result; it is rewritten after each run, and a run that would start with less than
its expected time left in --budget-s is skipped (a later run takes it with --only). Run the
references' two-GPU rows on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaling import TRAIN_MFU, measure, train_mfu_flags, write_json  # noqa: E402
from tessera.cli import plan  # noqa: E402

DP_OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
TP_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"] + DP_OVERLAP


def _context(tokens: int, kind: str) -> list[str]:
    return ["--context-parallel-size", "2", "--cp-comm-type", kind, "--seq-length", str(tokens),
            "--micro-batch-size", "1"]


# name -> (config, flags)
RUNS = {
    "A DP=2 distributed optimizer, overlaps": ("A", DP_OVERLAP),
    "A TP=2 + SP": ("A", TP_SP),
    "A TP=2 + SP, --tp-comm-overlap": ("A", TP_SP + ["--tp-comm-overlap"]),
    "A PP=2 interleaved, p2p overlap": ("A", ["--pipeline-model-parallel-size", "2", "--global-batch-size", "64",
                                             "--num-layers-per-virtual-pipeline-stage", "6",
                                             "--overlap-p2p-communication"]),
    **{f"B CP=2 {tokens // 1024}k {kind}": ("B", _context(tokens, kind))
       for tokens in (32768, 65536) for kind in ("p2p", "all_gather", "a2a")},
    **{f"M EP=2 {dispatcher}": ("M", ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", dispatcher,
                                      "--use-distributed-optimizer"]) for dispatcher in ("alltoall", "allgather")},
    "B FP8 DP=2": ("B", FP8),
    "B FP8 DP=2, --fp8-param-gather": ("B", FP8 + ["--fp8-param-gather"]),
}
EXPECTED_S = 100   # a run's start, compilation and 30 steps, about


def predict(config: str, flags: list[str]) -> dict:
    """`tessera plan --explain` of the run's flags on 2 GPUs of a DGX H200, as JSON."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        plan.main(["--explain", "--json", "--gpu", "h200", "--gpus", "2", *train_mfu_flags(config), *flags])
    return json.loads(printed.getvalue())[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="+", choices=sorted(RUNS), metavar="NAME", help="these runs only")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting runs after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="predict and write the commands; run nothing")
    args = parser.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "two_gpus.json"
    runs = json.loads(target.read_text())["runs"] if target.exists() else {}   # a later call adds to it
    for name in args.only or RUNS:
        config, flags = RUNS[name]
        command = ["torchrun", "--nproc-per-node", "2", str(TRAIN_MFU), "--config", config, "--", *flags]
        run = {"command": command, "predicted": predict(config, flags), "measured": None}
        if not args.dry_run:
            if time.monotonic() - start + EXPECTED_S > args.budget_s:
                print(f"skipped (budget): {name}", flush=True)
                continue
            print(" ".join(command), flush=True)
            run["measured"] = measure(command)
        runs[name] = run
        write_json(target, {"runs": runs})


if __name__ == "__main__":
    main()

"""Time to first step: a cold start, a second start on the same machine, and a resume with the
checkpoint's compile artifacts on empty caches.

    python bench/cold_start.py --config B --out cold_b.json
    python bench/cold_start.py --config B --out cold_b_fp8.json -- --fp8-format e4m3 --fp8-recipe tensorwise
    python bench/cold_start.py --tiny           (a CPU check: tiny-llama with --compile)

Each run is `tessera train` in a process of its own, with bench/train_mfu.py's shape for the
config and --train-iters 2 --log-interval 1; each reports its wall time from the process's
start to its first logged iteration, and its start-up line (import, build, load, first step):

    cold     empty compile caches (TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR in a new folder);
             it saves a checkpoint at its last iteration, with its compile artifacts
    warm     the same caches again: a second run on one machine
    resumed  empty caches again, --load of the cold run's checkpoint: the artifacts alone

Prints one line a run and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import COMMON, CONFIGS  # noqa: E402

TINY = ["--model", "tiny-llama", "--mock-data", "--device", "cpu", "--compile", "--lr", "1e-4"]
STARTUP = re.compile(r"start-up took ([\d.]+) s: (.*)")


def run(flags: list[str], caches: Path) -> dict:
    """One `tessera train`: seconds to its first iteration line, and its start-up phases."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"), TRITON_CACHE_DIR=str(caches / "triton"))
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "tessera", "train", *flags], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    row, lines = {}, []
    for line in process.stdout:
        lines.append(line)
        if (found := STARTUP.search(line)) is not None:
            row["startup_s"] = float(found.group(1))
            row["phases_s"] = {name: float(seconds) for name, seconds in
                               re.findall(r"([a-z][a-z ()]*?) ([\d.]+) s", found.group(2))}
        if "first_iteration_s" not in row and re.search(r"\] iteration +\d+/", line):
            row["first_iteration_s"] = time.perf_counter() - start
    if process.wait() != 0 or "first_iteration_s" not in row:
        raise RuntimeError("tessera train failed:\n" + "".join(lines[-20:]))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="B")
    parser.add_argument("--tiny", action="store_true", help="a CPU check on tiny-llama")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("extra", nargs="*", help="more tessera flags (after --)")
    args = parser.parse_args()
    shape = TINY if args.tiny else COMMON + CONFIGS[args.config]
    with tempfile.TemporaryDirectory(prefix="tessera-cold-") as scratch:
        scratch = Path(scratch)
        checkpoint = scratch / "checkpoint"
        flags = shape + args.extra + ["--train-iters", "2", "--log-interval", "1"]
        rows = {}
        rows["cold"] = run(flags + ["--save", str(checkpoint), "--save-interval", "2"], scratch / "caches")
        rows["warm"] = run(flags, scratch / "caches")
        rows["resumed"] = run(shape + args.extra + ["--train-iters", "4", "--log-interval", "1",
                                                    "--load", str(checkpoint)], scratch / "fresh")
    for name, row in rows.items():
        phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in row.get("phases_s", {}).items())
        print(f"{name:>8}: first iteration after {row['first_iteration_s']:6.1f} s | {phases}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"config": "tiny" if args.tiny else args.config,
                                              "extra": args.extra, **rows}, indent=1))


if __name__ == "__main__":
    main()

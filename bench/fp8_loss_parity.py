"""FP8 against bf16 on real text (loss parity): one model, data, seed and schedule,
trained in bf16 and with FP8 linears per recipe, validated every --eval-interval steps.

    python bench/fp8_loss_parity.py [--steps 1000] [--recipes bf16 tensorwise blockwise] [--at-once]
        [--out fp8_loss_parity.json] [--plot docs/figures/fp8_loss_parity.png]

Data: the Python standard library's sources (as `make demo`: examples/demo.py's corpus, a
byte-level BPE of 16,384 tokens, Megatron .bin/.idx with end-of-document tokens, split 98/2),
built once under --work. A standard library is 3-8M tokens, which 1,000 steps of 16k tokens
repeat; `--more-sources DIR` adds the Python files under DIR (a site-packages) and `--corpus-mb`
caps the whole, for a corpus the run does not repeat (~100 MB for 1,000 steps).
Model (`--size 350m`): LLaMA-style, 24 layers x 1024 (16 heads, SwiGLU
ffn 2816, RMSNorm, RoPE), untied embeddings: 342M parameters; sequence 1024,
global batch 16; AdamW 3e-4 with cosine decay to 3e-5 after 100 warm-up steps, clip 1.0; bf16
weights with fp32 masters (the distributed optimizer). FP8 on the transformer layers' linears,
the hybrid format for tensorwise and delayed, e4m3 for blockwise (as the speed runs of
docs/performance.md). `--size tiny` (2 x 64) checks the script on a CPU (bf16 only: FP8
needs a GPU with FP8 tensor cores).

--at-once trains the recipes side by side, one process each on the same GPU (the losses are
what this measures, not the speed: each run's seconds are then shared time).

Prints each run's final validation loss, its gap to bf16's, its skipped and non-finite steps,
and writes the curves as JSON (and as a PNG with --plot).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from demo import prepare  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

SIZES = {
    "350m": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "2816",
             "--seq-length", "1024",
             "--micro-batch-size", "16", "--global-batch-size", "16"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
             "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "4"],
}
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--make-vocab-size-divisible-by", "128"]
RECIPES = {"bf16": [], "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
           "delayed": ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
           "blockwise": ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]}


def run(recipe: str, flags: list[str], log_json: Path) -> dict:
    """One training run: per-step losses, (iteration, validation loss) pairs, skipped and non-finite steps."""
    config, _ = parse_run_config(flags + RECIPES[recipe] + ["--log-json", str(log_json)], "bench/fp8_loss_parity.py")
    trainer = Trainer(config)
    start = time.perf_counter()
    history = trainer.train()
    seconds = time.perf_counter() - start
    evals = [(r["iteration"], r["eval_loss"]) for r in map(json.loads, log_json.read_text().splitlines())
             if "eval_loss" in r]
    result = dict(recipe=recipe, seconds=round(seconds, 1), losses=[r.loss for r in history], evals=evals,
                  skipped=trainer.skipped_iterations, nonfinite=trainer.nan_iterations,
                  peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def run_at_once(recipes: list[str], script_args: list[str], logs: Path) -> list[dict]:
    """Each recipe in a process of its own, all started together; their results in `recipes`' order."""
    children = []
    for recipe in recipes:
        out = logs / f"{recipe}.json"
        command = [sys.executable, __file__, *script_args, "--recipes", recipe, "--out", str(out)]
        children.append((recipe, out, subprocess.Popen(command)))
    failed = [recipe for recipe, _, child in children if child.wait() != 0]
    if failed:
        raise SystemExit(f"bench/fp8_loss_parity.py: the {', '.join(failed)} run(s) failed (their output is above)")
    return [json.loads(out.read_text())["runs"][0] for _, out, _ in children]


def summarize(results: list[dict]) -> list[dict]:
    """Each run's final validation loss and its relative gap to the bf16 run's (None without one)."""
    reference = next((r["evals"][-1][1] for r in results if r["recipe"] == "bf16"), None)
    rows = []
    for r in results:
        final = r["evals"][-1][1]
        rows.append(dict(recipe=r["recipe"], final_eval_loss=final, skipped=r["skipped"], nonfinite=r["nonfinite"],
                         gap_to_bf16=None if reference is None else (final - reference) / reference))
    return rows


def plot(results: list[dict], path: Path, title: str) -> Path:
    """Validation loss (markers and lines) and training loss (faint) against the step, one colour a run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for index, r in enumerate(results):
        colour = f"C{index}"
        axes.plot(range(1, len(r["losses"]) + 1), r["losses"], color=colour, alpha=0.25, linewidth=0.8)
        steps, losses = zip(*r["evals"])
        axes.plot(steps, losses, "o-", color=colour, markersize=3, label=f"{r['recipe']} (validation)")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_yscale("log")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp.png")   # written whole, then renamed
    figure.savefig(partial, bbox_inches="tight")
    plt.close(figure)
    os.replace(partial, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="350m")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=["bf16", "tensorwise", "blockwise"])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "fp8_parity",
                        help="where the dataset is built (in a directory named after its sources)")
    parser.add_argument("--more-sources", type=Path, nargs="+", default=[],
                        help="directories whose Python files join the standard library's in the corpus")
    parser.add_argument("--corpus-mb", type=float, help="cap the corpus at this many MB (default: all of it)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "fp8_loss_parity.json")
    parser.add_argument("--plot", type=Path, help="write the curves as a PNG here")
    parser.add_argument("--at-once", action="store_true", help="train the recipes side by side, a process each")
    parser.add_argument("--log-dir", type=Path, help="keep each run's trainer log (JSON lines) here, written as it "
                        "trains (default: a temporary directory)")
    args = parser.parse_args()
    corpus_mb = 1 if args.corpus_mb is None and args.size == "tiny" else args.corpus_mb   # tiny: a CPU check
    sources = "stdlib" + "".join(f"+{path.name}" for path in args.more_sources) + \
        (f"-{corpus_mb:g}MB" if corpus_mb is not None else "")
    work = args.work / sources   # another corpus, another directory: a built one is never reused by mistake
    data, tokenizer = prepare(work, vocab=16384, max_mb=corpus_mb, more_roots=tuple(args.more_sources))
    flags = SIZES[args.size] + LLAMA + [
        "--data-path", str(data), "--split", "98,2,0", "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", str(tokenizer), "--data-cache-path", str(work / "cache"), "--num-workers", "1",
        "--train-iters", str(args.steps), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(min(100, args.steps // 10)), "--weight-decay", "0.1", "--adam-beta2", "0.95",
        "--clip-grad", "1.0", "--seed", "1234", "--bf16", "--use-distributed-optimizer",
        "--log-interval", str(args.eval_interval), "--eval-interval", str(args.eval_interval), "--eval-iters", "8"]
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        logs = args.log_dir or Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        if args.at_once:   # the dataset is built above, once, before the runs start
            shared = ["--size", args.size, "--steps", str(args.steps), "--eval-interval", str(args.eval_interval),
                      "--work", str(args.work), "--log-dir", str(logs)]
            shared += ["--more-sources", *map(str, args.more_sources)] if args.more_sources else []
            shared += ["--corpus-mb", str(corpus_mb)] if corpus_mb is not None else []
            results = run_at_once(args.recipes, shared, logs)
        else:
            for recipe in args.recipes:
                results.append(run(recipe, flags, logs / f"{recipe}.jsonl"))
                print(f"{recipe}: {results[-1]['seconds']} s, final validation loss "
                      f"{results[-1]['evals'][-1][1]:.4f}", flush=True)
    rows = summarize(results)
    for row in rows:
        gap = "" if row["gap_to_bf16"] is None else f", {row['gap_to_bf16']:+.2%} against bf16"
        print(f"RESULT {row['recipe']}: validation loss {row['final_eval_loss']:.4f}{gap}; "
              f"{row['skipped']} skipped, {row['nonfinite']} non-finite steps")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(size=args.size, steps=args.steps, summary=rows, runs=results), indent=1))
    if args.plot:
        plot(results, args.plot, f"bf16 and FP8 training, {args.size} LLaMA-style model on the stdlib corpus")


if __name__ == "__main__":
    main()

"""GRPO on a verifiable task, on a CPU in minutes: a tiny model learns two-number addition.

    python examples/grpo.py                 # SFT, then GRPO; prints held-out accuracy before and after
    python examples/grpo.py --quick         # a few steps of each, to check that it runs

1. Data: prompts "a+b=" with a in 10..99 ending in 0..4 and b in 0..5 (no carry); the answer
   is written "#### c" (GSM8K's mark, which the exact_match reward reads). 200 prompts train,
   the 70 others are held out: their digits' sums are ones the model has seen, in other pairs.
2. SFT (`tessera train --sft`): a short supervised run on the worked answers, stopped early
   so that the model answers some held-out prompts right and many wrong.
3. GRPO (`tessera train --grpo --pretrained-checkpoint <the SFT checkpoint>`): 8 answers
   sampled per prompt by the inference engine, rewarded by exact_match and format, the
   clipped group-relative policy gradient (tessera.posttrain.grpo).
4. Held-out accuracy: greedy answers from the engine, checked by the same exact_match.

Each stage is the `tessera train` command line below, run through the same parser; the
byte-level tokenizer needs no files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tessera.cli.args import parse_run_config
from tessera.inference.engine import Engine
from tessera.inference.sampling import SamplingParams
from tessera.posttrain.rewards import exact_match
from tessera.training.trainer import Trainer

EOD = 256   # ByteTokenizer's end of document: where an answer stops
MODEL = ["--num-layers", "2", "--hidden-size", "96", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
         "--ffn-hidden-size", "256", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--vocab-size", "264",
         "--make-vocab-size-divisible-by", "8", "--seq-length", "16", "--max-position-embeddings", "16",
         "--tokenizer-type", "ByteTokenizer", "--sft-tokenizer-prompt-format", "identity",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--seed", "3",
         "--device", "cpu", "--no-compile"]
SFT = ["--sft", "--micro-batch-size", "16", "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-3",
       "--lr-warmup-iters", "10", "--split", "1"]
GRPO = ["--grpo", "--grpo-group-size", "8", "--grpo-max-new-tokens", "8", "--grpo-temperature", "1",
        "--grpo-reward", "exact_match", "format", "--grpo-format-regex", r"^#### \d+$", "--grpo-iterations", "2",
        "--micro-batch-size", "32", "--global-batch-size", "64", "--lr", "1e-3", "--min-lr", "1e-3",
        "--lr-warmup-iters", "0", "--clip-grad", "1.0", "--split", "1"]


def problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held out) rows {"prompt", "answer"}, no sum of the one among the other's."""
    pairs = [(a, b) for a in range(10, 100) if a % 10 < 5 for b in range(6)]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return rows[:200], rows[200:]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def train(flags: list[str]) -> Trainer:
    trainer = Trainer(parse_run_config(MODEL + flags, "examples/grpo.py", world_size=1)[0])
    trainer.train()
    return trainer


@torch.no_grad()
def accuracy(model, rows: list[dict]) -> float:
    """The fraction of rows whose greedy answer exact_match accepts."""
    engine = Engine(model, max_requests=len(rows), eos_token_ids=[EOD], cuda_graphs=False, compile=False)
    prompts = [list(row["prompt"].encode()) for row in rows]
    completions = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    texts = [bytes(t for t in c.token_ids if t < EOD).decode("utf-8", "replace") for c in completions]
    return sum(exact_match(row["prompt"], text, row["answer"]) for row, text in zip(rows, texts)) / len(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of each stage (a smoke test)")
    parser.add_argument("--sft-iters", type=int, default=40)
    parser.add_argument("--grpo-iters", type=int, default=30)
    args = parser.parse_args(argv)
    sft_iters, grpo_iters = (4, 2) if args.quick else (args.sft_iters, args.grpo_iters)
    train_rows, held_out = problems()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        sft_data = write_jsonl(work / "sft.jsonl", [{"prompt": r["prompt"], "completion": f"#### {r['answer']}"}
                                                     for r in train_rows])
        grpo_data = write_jsonl(work / "prompts.jsonl", train_rows)
        start = time.perf_counter()
        sft = train(SFT + ["--data-path", sft_data, "--train-iters", str(sft_iters), "--log-interval", "20",
                           "--save", str(work / "sft")])
        before = accuracy(sft.model, held_out)
        print(f"after SFT ({sft_iters} steps, {time.perf_counter() - start:.0f} s): held-out accuracy {before:.0%}",
              flush=True)
        start = time.perf_counter()
        grpo = train(GRPO + ["--data-path", grpo_data, "--train-iters", str(grpo_iters), "--log-interval", "10",
                             "--pretrained-checkpoint", str(work / "sft")])
        after = accuracy(grpo.model, held_out)
        print(f"after GRPO ({grpo_iters} steps, {time.perf_counter() - start:.0f} s): held-out accuracy {after:.0%} "
              f"(from {before:.0%})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

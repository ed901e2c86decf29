"""GRPO's step on one GPU: rollout, log-prob and train time, and the engine's speed inside the RL
loop against the same engine generating alone.

    python bench/grpo_step.py --model qwen2.5-0.5b --steps 6 --prompts 32 --group 8 --new 256 --bf16

A Qwen2.5-0.5B-shaped model with random weights (`--model` takes any preset; `--config tiny`
is a CPU check), byte-level tokens, prompts "a+b=" rewarded by exact_match (random weights
earn nothing; the speed is what is measured). `tessera train --grpo` runs `--steps` steps of
`--prompts` x `--group` answers of at most `--new` tokens (random weights over a 152k-token
vocabulary almost never draw the end of document, so nearly all run to `--new`). Per step: `rollout_seconds` and
`train_seconds` (GRPOObjective's metrics; the log-prob passes of --grpo-iterations > 1 and the
KL reference fall in the rollout), rollout tokens/s = answer tokens / rollout seconds. Then the
same engine, on the trained model, generates the same requests alone (Engine.generate, timed
after one untimed run): the RL loop's rollout should reach >= 90% of it. The first step (which
builds the engine, compiles its decode step and captures its CUDA graphs) is left out of the
means. Prints a table and a RESULT line; writes $OUT/grpo_step.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--config", choices=("preset", "tiny"), default="preset")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    rows = args.prompts * args.group
    with tempfile.TemporaryDirectory() as work:
        data = Path(work) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{i % 97}+{i % 13}=", "answer": str(i % 97 + i % 13)}) + "\n"
                                for i in range(4 * args.prompts)))
        model = ["--model", "tiny-llama"] if args.config == "tiny" else ["--model", args.model]
        flags = model + ["--grpo", "--data-path", str(data), "--tokenizer-type", "ByteTokenizer",
                         "--sft-tokenizer-prompt-format", "identity", "--seq-length", str(args.new + 16),
                         "--grpo-max-new-tokens", str(args.new), "--grpo-group-size", str(args.group),
                         "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(rows),
                         "--train-iters", str(args.steps), "--lr", "1e-6", "--log-interval", "1",
                         "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0"]
        flags += ["--bf16"] if args.bf16 else []
        trainer = Trainer(parse_run_config(flags, "bench/grpo_step.py")[0])
        history = trainer.train()
    later = history[1:] or history
    rollout = sum(r.terms["rollout_seconds"] for r in later) / len(later)
    train = sum(r.terms["train_seconds"] for r in later) / len(later)
    tokens = sum(r.terms["completions/mean_length"] for r in later) / len(later) * rows
    alone = generate_alone(trainer, rows, args.new)
    result = {"model": args.model if args.config == "preset" else "tiny", "rows": rows, "new": args.new,
              "rollout_s": rollout, "train_s": train, "rollout_tokens_per_s": tokens / rollout,
              "generate_alone_tokens_per_s": alone, "ratio": tokens / rollout / alone}
    print(f"{'rollout s':>10} {'train s':>10} {'RL tok/s':>10} {'alone tok/s':>12} {'ratio':>7}")
    print(f"{rollout:10.2f} {train:10.2f} {tokens / rollout:10.0f} {alone:12.0f} {result['ratio']:7.1%}")
    print("RESULT " + json.dumps(result))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "grpo_step.json").write_text(json.dumps(result, indent=1))


def generate_alone(trainer: Trainer, rows: int, new: int) -> float:
    """Tokens/s of the rollouts' engine generating the last rollout's kind of requests by itself."""
    from tessera.inference.sampling import SamplingParams

    engine = trainer.train_data.engine
    prompts = [list(f"{i % 97}+{i % 13}=".encode()) for i in range(rows)]
    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=i, ignore_eos=True, logprobs=0) for i in range(rows)]
    engine.generate(prompts, params)   # untimed: the batch shape's graphs
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in completions) / (time.perf_counter() - start)


if __name__ == "__main__":
    main()

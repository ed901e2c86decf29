"""`make demo`: train a small GPT for about a minute, then sample from it.

The model learns --mock-data sequences (arithmetic progressions modulo the vocabulary,
each with its own start and stride), so the samples show whether it learned the rule:
given 3 tokens of a progression, it should continue it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.inference.generate import generate  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

FLAGS = [
    "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
    "--vocab-size", "256", "--make-vocab-size-divisible-by", "8", "--position-embedding-type", "rope",
    "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--hidden-dropout", "0", "--attention-dropout", "0",
    "--mock-data", "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "300",
    "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "30",
    "--log-interval", "25", "--eval-interval", "100", "--eval-iters", "4",
]


def main() -> None:
    config, _ = parse_run_config(FLAGS + sys.argv[1:], "examples/demo.py")
    print("tessera demo: training a 4-layer LLaMA-style model on --mock-data\n")
    trainer = Trainer(config)
    trainer.train()
    print("\nsamples (prompt -> greedy continuation; the model should extend each progression):")
    for start, stride in [(10, 1), (100, 3), (250, 2)]:
        prompt = torch.tensor([[(start + stride * i) % 256 for i in range(3)]], device=trainer.device)
        out = generate(trainer.model, prompt, max_new_tokens=8, temperature=0, vocab_size=256)[0].tolist()
        expected = [(start + stride * i) % 256 for i in range(11)]
        verdict = "correct" if out == expected else f"expected {expected[3:]}"
        print(f"  {out[:3]} -> {out[3:]}  ({verdict})")


if __name__ == "__main__":
    main()

"""Post-training speed on one GPU: pretraining, full SFT, LoRA SFT and DPO on the same shape.

    python bench/posttrain.py [--layers 8] [--seq 4096] [--warmup 5] [--steps 10] [--out rows.jsonl]
    python bench/posttrain.py --tiny            (a CPU smoke run of every row)

On an H200, beside the transformers + PEFT anchor in the same call (its script is not part of
tessera; `--compile` is TRL's torch_compile=True):

    python bench/posttrain.py --out $OUT/posttrain.jsonl && python peft_sft.py --compile

Shape: `--layers` of LLaMA-3-8B (4096 wide, 32 heads / 8 KV groups, SwiGLU 14336, vocab 128256),
rows of `--seq` tokens, bf16 autocast, dropout 0. Rows, each in a process of its own:

    pretrain  --mock-data, micro-batch 1: the MFU full SFT is held to
    sft       --sft on generated conversations packed into rows (byte tokens, the identity
              format), micro-batch 1; MFU counts attention per conversation, as the log does
    lora      --mock-data with --lora-rank 16 --lora-alpha 32 on qkv, proj, fc1 and fc2, micro-batch
              1: the anchor's workload (its tokens/s and peak memory are the ones to compare)
    sft2/dpo  --sft and --dpo (precomputed reference) on two rows a step, micro-batch 2: a DPO step
              against an SFT step over the same token slots

Prints one line a row and writes them as JSON lines to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import measure  # noqa: E402

SFT_DATA = ["--sft-tokenizer-prompt-format", "identity", "--tokenizer-type", "ByteTokenizer", "--split", "1"]
ROWS = {
    "pretrain": ["--mock-data", "--micro-batch-size", "1"],
    "sft": ["--sft", "--data-path", "{conversations}", *SFT_DATA, "--micro-batch-size", "1"],
    "lora": ["--mock-data", "--micro-batch-size", "1", "--lora-rank", "16", "--lora-alpha", "32"],
    "sft2": ["--sft", "--data-path", "{conversations}", *SFT_DATA, "--micro-batch-size", "2"],
    "dpo": ["--dpo", "--data-path", "{pairs}", *SFT_DATA, "--micro-batch-size", "2"],
}
TINY = ["--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--vocab-size", "512", "--device", "cpu"]


def shape(layers: int, seq: int, tiny: bool) -> list[str]:
    return ["--model", "llama3-8b", "--num-layers", str(layers), "--seq-length", str(seq), "--hidden-dropout", "0",
            "--attention-dropout", "0", "--lr", "1e-5", "--log-interval", "1000000", "--num-workers", "0"] + \
        (TINY if tiny else ["--bf16"])


def write_data(directory: Path, seq: int) -> dict[str, str]:
    """Conversations (a user turn and an answer, 1/16 to 1/2 of a row each) and preference pairs
    that fill about three quarters of a row, in bytes: byte tokens make their lengths exact."""
    rng = random.Random(0)

    def text(low: int, high: int) -> str:
        return "".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=rng.randint(low, high)))

    paths = {"conversations": directory / "conversations.jsonl", "pairs": directory / "pairs.jsonl"}
    with open(paths["conversations"], "w") as out:
        for _ in range(4000):
            out.write(json.dumps({"messages": [{"role": "user", "content": text(seq // 16, seq // 4)},
                                               {"role": "assistant", "content": text(seq // 16, seq // 4)}]}) + "\n")
    with open(paths["pairs"], "w") as out:
        for _ in range(400):
            out.write(json.dumps({"prompt": text(seq // 4, seq // 2), "chosen": text(seq // 8, seq // 4),
                                  "rejected": text(seq // 8, seq // 4)}) + "\n")
    return {name: str(path) for name, path in paths.items()}


def run_row(args: argparse.Namespace) -> None:
    data = json.loads(args.data)
    flags = shape(args.layers, args.seq, args.tiny) + [flag.format(**data) for flag in ROWS[args.row]] + \
        ["--train-iters", str(args.warmup + args.steps)]
    result = measure(flags, warmup=args.warmup, steps=args.steps)
    print("ROW " + json.dumps({"name": args.row, **result}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks every row runs")
    parser.add_argument("--out", help="write the rows as JSON lines here")
    parser.add_argument("--row", choices=sorted(ROWS), help=argparse.SUPPRESS)   # one row, in this process
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.seq, args.warmup, args.steps = 2, 256, 1, 1
    if args.row:
        return run_row(args)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        data = json.dumps(write_data(Path(directory), args.seq))
        for row in ROWS:   # a process each: one model's compiled graphs and memory do not meet the next's
            command = [sys.executable, __file__, "--row", row, "--data", data, "--layers", str(args.layers),
                       "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
            output = subprocess.run(command + (["--tiny"] if args.tiny else []), capture_output=True, text=True)
            lines = [line for line in output.stdout.splitlines() if line.startswith("ROW ")]
            if output.returncode or not lines:
                print(f"{row}: failed\n{output.stderr[-3000:]}", flush=True)
                continue
            rows.append(json.loads(lines[-1][4:]))
            r = rows[-1]
            print(f"{row:>8}: {r['tokens_per_sec']:>9,.0f} tokens/s | {r['ms_per_step']:8.1f} ms/step | "
                  f"MFU {r['mfu'] * 100:5.1f}% | peak {r['peak_alloc_gib']:.1f} GiB", flush=True)
    by_name = {r["name"]: r for r in rows}
    if {"dpo", "sft2"} <= by_name.keys():
        print(f"DPO step / SFT step over the same tokens: {by_name['dpo']['ms_per_step'] / by_name['sft2']['ms_per_step']:.2f}x")
    if {"sft", "pretrain"} <= by_name.keys():
        print(f"full SFT MFU / pretraining MFU: {by_name['sft']['mfu'] / max(by_name['pretrain']['mfu'], 1e-12):.3f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()

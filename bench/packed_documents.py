"""Packed-document training on one GPU: document-masked attention against the dense mask and
against plain causal attention, and the longest sequence that fits.

    python bench/packed_documents.py [--seq-lengths 8192 32768] [--steps 10] [--out result.json]
    python bench/packed_documents.py --longest [--longest-layers 4]

Writes a .bin/.idx dataset of documents with mixed lengths (log-normal, median 1k tokens,
64 to 16k; NullTokenizer, EOD = vocab - 1) and trains config B's model (LLaMA-style 1.2B,
bf16, no recompute) on it with --reset-attention-mask --reset-position-ids --eod-mask-loss.
Rows per sequence length, each at ~16k tokens per step (micro-batch 16k / seq):

- "documents": the default document kernel (tessera.models.documents.default_backend);
- "dense-mask" (only up to --dense-max): the same data through SDPA with the [b, s, s] mask,
  what --reset-attention-mask did before the document kernels;
- "causal": the same tokens without --reset-attention-mask: one causal sequence per sample.

MFU counts what each row computes: with documents, attention FLOPs over the sum of squared
document lengths (Megatron's THD count), so a documents row and a causal row at the same
tokens/s differ in MFU by the attention they skip. --longest doubles the sequence length of
llama3-8b-shaped layers (--longest-layers of them) from --longest-start, with and without full
recompute, until a step runs out of memory, and reports the longest that ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import COMMON, CONFIGS  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.data.indexed import IndexedDatasetWriter  # noqa: E402
from tessera.perf.flops import flops_per_iteration  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

VOCAB = 32000
TOKENS_PER_STEP = 16384


def write_documents(prefix: Path, num_tokens: int, seed: int = 0) -> dict:
    """Documents of log-normal lengths, each closed by EOD, `num_tokens` in all."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(1024), 1.0, size=num_tokens // 256), 64, 16384).astype(np.int64)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), num_tokens) + 1]
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for length in lengths:
            tokens = rng.integers(0, VOCAB - 1, size=length)
            tokens[-1] = VOCAB - 1
            writer.add_document(tokens)
    return {"documents": len(lengths), "median_length": float(np.median(lengths)),
            "mean_length": float(lengths.mean())}


def run(flags: list[str], steps: int, warmup: int, backend: str | None = None) -> dict:
    """Train `warmup` + `steps` steps; tokens/s, MFU and peak memory of the timed ones."""
    config, _ = parse_run_config(flags + ["--train-iters", str(warmup + steps)], "bench/packed_documents.py")
    trainer = Trainer(config)
    if backend is not None:
        trainer.document_backend = backend
    try:
        for _ in range(warmup):
            trainer.train_step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        trainer._document_squares = 0 if trainer._document_squares is not None else None
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        squares = trainer._document_squares
        batch, seq = config.train.global_batch_size, config.model.seq_length
        flops = flops_per_iteration(config.model, batch, seq, vocab_size=trainer.model.vocab_size,
                                    squared_document_lengths=None if squares is None else squares / steps)
        return {"tokens_per_sec": steps * batch * seq / elapsed, "ms_per_step": elapsed / steps * 1e3,
                "tflops": flops * steps / elapsed / 1e12, "mfu": flops * steps / elapsed / 989e12,
                "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
                "backend": trainer.document_backend if squares is not None else "causal sdpa",
                "mean_document_squares_per_step": None if squares is None else squares / steps}
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def throughput(args, data: Path) -> list[dict]:
    rows = []
    packed = ["--data-path", str(data), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
              "--split", "100,0,0"]
    for seq in args.seq_lengths:
        base = [f for f in COMMON if f != "--mock-data"] + CONFIGS["B"] + packed + [
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", str(max(TOKENS_PER_STEP // seq, 1))]
        documents = base + ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
        settings = [("documents", documents, None), ("causal", base, None)]
        if seq <= args.dense_max:
            settings.insert(1, ("dense-mask", documents, "dense"))
        for name, flags, backend in settings:
            row = {"row": name, "seq_length": seq, **run(flags, args.steps, args.warmup, backend)}
            print(f"RESULT packed {name:10s} seq {seq:6d}: {row['tokens_per_sec']:,.0f} tokens/s | "
                  f"{row['tflops']:.1f} TFLOP/s | MFU {row['mfu'] * 100:.1f}% | peak {row['peak_alloc_gib']:.1f} GiB"
                  f" | {row['backend']}", flush=True)
            rows.append(row)
    return rows


def longest(args) -> list[dict]:
    rows = []
    full = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    for recompute in [{"none": [], "full": full}[mode] for mode in args.longest_modes]:
        best, seq = None, args.longest_start
        while seq <= args.longest_max:
            flags = COMMON + ["--model", "llama3-8b", "--num-layers", str(args.longest_layers),
                              "--seq-length", str(seq), "--max-position-embeddings", str(seq),
                              "--micro-batch-size", "1"] + recompute
            try:
                result = run(flags, steps=1, warmup=1)
            except torch.cuda.OutOfMemoryError:
                break
            best = {"seq_length": seq, **result}
            seq *= 2
        row = {"row": "longest", "recompute": bool(recompute), "layers": args.longest_layers, "fits": best}
        fits = f"{best['seq_length']} tokens (peak {best['peak_alloc_gib']:.1f} GiB)" if best else "nothing"
        print(f"RESULT longest llama3-8b x {args.longest_layers} layers, recompute {'full' if recompute else 'none'}:"
              f" {fits}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--dense-max", type=int, default=8192, help="longest sequence run with the dense mask")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--longest", action="store_true", help="search the longest llama3-8b-shaped sequence")
    parser.add_argument("--longest-layers", type=int, default=4)
    parser.add_argument("--longest-start", type=int, default=16384)
    parser.add_argument("--longest-max", type=int, default=262144)
    parser.add_argument("--longest-modes", nargs="+", choices=("none", "full"), default=["none", "full"],
                        help="recompute settings searched")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.longest:
        result["longest"] = longest(args)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "documents"
            result["data"] = write_documents(data, 4 * TOKENS_PER_STEP * (args.steps + args.warmup) * 2)
            result["rows"] = throughput(args, data)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

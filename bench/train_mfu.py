"""Training throughput and MFU of tessera on one GPU, for the anchors' configs A and B.

    python bench/train_mfu.py --config A [--warmup 10] [--steps 20] [--out result.json] [-- extra tessera flags]
    torchrun --nproc-per-node 2 bench/train_mfu.py --config A -- --tensor-model-parallel-size 2

Micro-batch 8 per data-parallel rank (global batch 8 x DP). With several GPUs, tokens/s is
per GPU from the slowest rank's time, and memory is the fullest GPU's, as the anchors do.

A: GPT 1.3B (24 x 2048, 16 heads, GeLU ffn 8192, LayerNorm, learned positions, vocab 50304,
   tied). B: LLaMA-style 1.2B (24 x 2048, 16 heads / 4 KV groups, SwiGLU ffn 5632,
   RMSNorm, RoPE 5e5, vocab 32000, untied). Both: seq 2048, micro-batch 8, bf16 autocast
   over fp32 master weights, AdamW (0.9, 0.95, wd 0.1), clip 1.0, dropout 0, no recompute:
   exactly the shapes and timing of shared/anchors/NOTES.md, so the numbers compare with
   the peers' (10 warm-up steps, then 20 timed steps with a device sync at both ends).
Prints one table row and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.perf.flops import flops_per_token  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

CONFIGS = {
    "A": ["--model", "gpt3-1.3b"],          # vocab 50257 is padded to 50304 (multiple of 128)
    "B": ["--model", "llama-1.2b"],
}
COMMON = ["--mock-data", "--bf16", "--seq-length", "2048", "--micro-batch-size", "8",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4", "--weight-decay", "0.1",
          "--adam-beta2", "0.95", "--clip-grad", "1.0", "--log-interval", "1000000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="A")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200)")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("extra", nargs="*", help="more tessera flags (after --)")
    args = parser.parse_args()
    flags = CONFIGS[args.config] + COMMON + ["--train-iters", str(args.warmup + args.steps)] + args.extra
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config, _ = parse_run_config(flags, "bench/train_mfu.py", world_size=world)
    trainer = Trainer(config)
    for _ in range(args.warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    losses = [trainer.train_step().loss for _ in range(args.steps)]
    torch.cuda.synchronize()
    elapsed, peak_alloc, peak_reserved = _max_over_ranks(
        [time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30,
         torch.cuda.max_memory_reserved() / 2**30])
    tokens_per_gpu = args.steps * config.train.global_batch_size * config.model.seq_length / world
    tflops = flops_per_token(config.model, vocab_size=trainer.model.vocab_size) * tokens_per_gpu / elapsed / 1e12
    result = {
        "row": "tessera", "config": args.config, "flags": flags, "gpus": world,
        "layout": f"TP{trainer.mesh.tp_size} DP{trainer.mesh.dp_size}", "tokens_per_sec": tokens_per_gpu / elapsed,
        "tokens_per_sec_total": tokens_per_gpu * world / elapsed,
        "ms_per_step": elapsed / args.steps * 1e3, "tflops_per_gpu": tflops, "mfu": tflops / args.peak_tflops,
        "peak_alloc_gib": peak_alloc, "peak_reserved_gib": peak_reserved,
        "optimizer_state_gib": trainer.optimizer.state_bytes() / 2**30,
        "first_loss": float(losses[0]), "last_loss": float(losses[-1]), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    if trainer.mesh.rank != 0:
        return
    losses = [float(x) for x in losses]
    print(f"RESULT tessera config {args.config} {world} GPU {result['layout']} {' '.join(args.extra)}: "
          f"{result['tokens_per_sec']:,.0f} tokens/s/GPU | "
          f"{result['ms_per_step']:.1f} ms/step | {tflops:.1f} TFLOP/s | MFU {result['mfu'] * 100:.1f}% | "
          f"peak {result['peak_alloc_gib']:.1f}/{result['peak_reserved_gib']:.1f} GiB | loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def _max_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, device="cuda")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


if __name__ == "__main__":
    main()

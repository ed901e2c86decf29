"""Training throughput and MFU of tessera on one GPU, for the anchors' configs A and B.

    python bench/train_mfu.py --config A [--warmup 10] [--steps 20] [--out result.json] [-- extra tessera flags]
    torchrun --nproc-per-node 2 bench/train_mfu.py --config A -- --tensor-model-parallel-size 2
    torchrun --nproc-per-node 2 bench/train_mfu.py --config A -- --pipeline-model-parallel-size 2 \
        --global-batch-size 64            # + --num-layers-per-virtual-pipeline-stage 6 to interleave

Micro-batch 8 per data-parallel rank (global batch 8 x DP). With several GPUs, tokens/s is
per GPU from the slowest rank's time, and memory is the fullest GPU's, as the anchors do.

A: GPT 1.3B (24 x 2048, 16 heads, GeLU ffn 8192, LayerNorm, learned positions, vocab 50304,
   tied). B: LLaMA-style 1.2B (24 x 2048, 16 heads / 4 KV groups, SwiGLU ffn 5632,
   RMSNorm, RoPE 5e5, vocab 32000, untied). M: the anchors' fine-grained MoE, B's
   attention in 12 layers, each with 64 experts (ffn 768), top-8, micro-batch 4. C: a coarse
   MoE, 12 such layers with 8 experts (ffn 5632), top-2. MoE: dropless, aux loss 1e-2,
   grouped GEMMs; MFU counts active FLOPs (Megatron's formula). L8: 8 of LLaMA-3-8B's layers,
   micro-batch 4 (the 8B-shaped FP8 pair). All: seq 2048, micro-batch 8
   unless said, bf16 autocast over fp32 master weights, AdamW (0.9, 0.95, wd 0.1), clip 1.0,
   dropout 0, no recompute: exactly the shapes and timing of the references in
   docs/performance.md, so the numbers compare with theirs (10 warm-up steps, then 20 timed steps with a device sync
   at both ends).
Prints one table row and writes JSON. With pipeline parallelism it also runs
--bubble-steps more steps, each followed by a device sync, and reports every stage's
measured idle fraction beside the theoretical (p-1)/(v*m+p-1). --memory-trace FILE
records the CUDA allocator's trace through the warm-up and writes, per rank, what is
alive at the last warm-up step's peak, grouped by the line that allocated it
(bench/memory_trace.py); the timed steps run after recording stops.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_state import GpuSampler  # noqa: E402
from memory_trace import format_breakdown, peak_breakdown, step_marker  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.perf.flops import flops_per_token  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402

# B's attention with a MoE MLP in 12 layers: top-k softmax renormalised, dropless, aux loss 1e-2.
_MOE = ["--model", "llama-1.2b", "--num-layers", "12", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm"]
CONFIGS = {
    "A": ["--model", "gpt3-1.3b"],          # vocab 50257 is padded to 50304 (multiple of 128)
    "B": ["--model", "llama-1.2b"],
    # M: the references' fine-grained MoE: 64 experts, top-8, expert ffn 768, micro-batch 4
    "M": _MOE + ["--num-experts", "64", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "768",
                 "--micro-batch-size", "4"],
    # C: a coarse MoE (Mixtral-like): 8 experts, top-2, expert ffn 5632 (B's MLP), micro-batch 8
    "C": _MOE + ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "5632"],
    # L8: 8 of LLaMA-3-8B's 32 layers (4096 wide, 32 heads / 8 KV groups, SwiGLU 14336, vocab 128256), micro-batch 4
    "L8": ["--model", "llama3-8b", "--num-layers", "8", "--micro-batch-size", "4"],
}
COMMON = ["--mock-data", "--bf16", "--seq-length", "2048", "--micro-batch-size", "8",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4", "--weight-decay", "0.1",
          "--adam-beta2", "0.95", "--clip-grad", "1.0", "--log-interval", "1000000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="A")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bubble-steps", type=int, default=3, help="steps measuring the pipeline bubble (PP > 1)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200)")
    parser.add_argument("--memory-trace", help="write each rank's peak-memory breakdown to FILE.rank<N>.json")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("extra", nargs="*", help="more tessera flags (after --)")
    args = parser.parse_args()
    flags = COMMON + CONFIGS[args.config] + ["--train-iters", str(args.warmup + args.steps + args.bubble_steps)] \
        + args.extra
    result = measure(flags, warmup=args.warmup, steps=args.steps, bubble_steps=args.bubble_steps,
                     peak_tflops=args.peak_tflops, memory_trace=args.memory_trace)
    result["config"] = args.config
    if result["rank"] != 0:
        return
    bubble = ""
    if "bubble_theory" in result:
        bubble = (f" | bubble {' '.join(f'{b:.1%}' for b in result['bubble_measured_per_stage'])}"
                  f" (theory {result['bubble_theory']:.1%})")
    print(f"RESULT tessera config {args.config} {result['gpus']} GPU {result['layout']} {' '.join(args.extra)}: "
          f"{result['tokens_per_sec']:,.0f} tokens/s/GPU | "
          f"{result['ms_per_step']:.1f} ms/step | {result['tflops_per_gpu']:.1f} TFLOP/s | MFU {result['mfu'] * 100:.1f}% | "
          f"peak {result['peak_alloc_gib']:.1f}/{result['peak_reserved_gib']:.1f} GiB | loss {result['first_loss']:.3f} -> "
          f"{result['last_loss']:.3f}{bubble}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def measure(flags: list[str], *, warmup: int, steps: int, bubble_steps: int = 0, peak_tflops: float = 989.0,
            memory_trace: str | None = None) -> dict:
    """A trainer built from tessera `flags` (which give --train-iters), `warmup` steps, then `steps`
    timed ones: the result row, on every rank (its "rank" says which). With packed documents
    the FLOPs count attention per document, as the trainer's log does."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config, _ = parse_run_config(flags, "bench/train_mfu.py", world_size=world)
    cuda = torch.cuda.is_available() and config.train.device != "cpu"
    if memory_trace and cuda:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=TRACE_ENTRIES)
    trainer = Trainer(config)
    for _ in range(warmup):
        step_marker(trainer.device)
        trainer.train_step()
    _synchronize(cuda)
    if memory_trace and cuda:
        _write_memory_trace(memory_trace, trainer.mesh.rank)
    if cuda and trainer.step_graph is None:
        # A replayed graph allocates nothing: its activations were counted when it was captured.
        torch.cuda.reset_peak_memory_stats()
    static_gib = torch.cuda.memory_allocated() / 2**30 if cuda else 0.0
    if world > 1:
        dist.barrier()
    trainer._document_squares = 0 if trainer._document_squares is not None else None   # the timed steps' alone
    start = time.perf_counter()
    with GpuSampler(torch.cuda.current_device() if cuda else 0, interval_s=0.1) as gpu_state:
        losses = [trainer.train_step().loss for _ in range(steps)]
        _synchronize(cuda)
    elapsed, peak_alloc, peak_reserved = _max_over_ranks(
        [time.perf_counter() - start, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
         torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0], trainer.device)
    mesh = trainer.mesh
    tokens_per_gpu = steps * config.train.global_batch_size * config.model.seq_length / world
    packed = trainer._packed_flops_per_iteration(steps)
    flops_per_gpu = packed * steps / world if packed is not None else \
        flops_per_token(config.model, vocab_size=trainer.model.vocab_size, frozen_base=config.posttrain.lora) \
        * tokens_per_gpu
    tflops = flops_per_gpu / elapsed / 1e12
    result = {
        "row": "tessera", "rank": mesh.rank, "flags": flags, "gpus": world, "layout": _layout(trainer),
        "global_batch_size": config.train.global_batch_size, "num_micro_batches": config.num_micro_batches,
        "tokens_per_sec": tokens_per_gpu / elapsed, "tokens_per_sec_total": tokens_per_gpu * world / elapsed,
        "ms_per_step": elapsed / steps * 1e3, "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops,
        "peak_alloc_gib": peak_alloc, "peak_reserved_gib": peak_reserved, "static_alloc_gib_rank0": static_gib,
        "optimizer_state_gib": trainer.optimizer.state_bytes() / 2**30,
        "first_loss": float(losses[0]), "last_loss": float(losses[-1]),
        "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "gpu_state": gpu_state.summary(),   # this rank's GPU during the timed steps
    }
    if mesh.pp_size > 1:
        result["bubble_measured_per_stage"] = _measure_bubble(trainer, bubble_steps)
        result["bubble_theory"] = trainer.pipeline.schedule.theoretical_bubble()
        result["schedule"] = trainer.pipeline.schedule.name
    return result


TRACE_ENTRIES = 2_000_000   # allocator events kept (a 1.3B model's build + a few steps is ~10^5)


def _layout(trainer) -> str:
    mesh, parallel = trainer.mesh, trainer.config.parallel
    vp = parallel.virtual_pipeline_size(trainer.config.model.num_layers) if mesh.pp_size > 1 else 1
    return (f"TP{mesh.tp_size}{'+SP' if parallel.sequence_parallel else ''} PP{mesh.pp_size}"
            f"{f'x{vp}' if vp > 1 else ''} DP{mesh.dp_size}")


def _measure_bubble(trainer, steps: int) -> list[float]:
    """Mean idle fraction of each pipeline stage over `steps` more steps (synchronised)."""
    measured = []
    for _ in range(steps):
        trainer.train_step()
        measured.append(trainer.pipeline.runner.measured_bubble())
    mine = torch.tensor([sum(measured) / max(len(measured), 1)], device=trainer.device)
    stages = [torch.zeros_like(mine) for _ in range(trainer.mesh.pp_size)]
    dist.all_gather(stages, mine, group=trainer.mesh.group("pp"))
    return [s.item() for s in stages]


def _write_memory_trace(path: str, rank: int) -> None:
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    result = peak_breakdown(trace)
    result["trace_full"] = len(trace) >= TRACE_ENTRIES   # the oldest events were dropped: totals are low
    target = Path(path)
    target = target.with_name(f"{target.stem}.rank{rank}{target.suffix or '.json'}")
    target.write_text(json.dumps(result, indent=1))
    print(f"rank {rank} memory at the peak of the last warm-up step:\n{format_breakdown(result)}", flush=True)


def _synchronize(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


if __name__ == "__main__":
    main()

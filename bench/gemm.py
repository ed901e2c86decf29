"""Kernel efficiency sweep for the planner: bf16 GEMMs, causal attention, HBM copy, on one GPU.

    python bench/gemm.py [--out tessera/perf/data/gemm_h200.json] [--quick]

Measures what tessera.perf.kernels models, and writes it as JSON that `fit_curves` reads:
- GEMMs over the shapes a transformer layer produces (tokens m = 1k..16k; n, k = 512..16k,
  the widths of QKV/projection/MLP GEMMs under TP 1..8), bf16 torch.matmul;
- fused causal attention (SDPA, cuDNN > flash) forward + backward at sequence 1k..16k,
  16k tokens per call, 16 heads of 128, on the FLOPs really done (2*b*s^2*h*d forward,
  2.5x that backward), and the slowdown with dropout 0.1;
- a 4 GiB device-to-device copy (read + write bytes).
Each measurement is the median of CUDA-event timings after warm-up. About 15 seconds on
an H200. Prints a table; `tessera plan` uses the committed JSON automatically.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.perf.hardware import detect_gpu  # noqa: E402
from tessera.perf.kernels import MEASURED_CURVE, fit_curves  # noqa: E402

TOKENS = (1024, 4096, 16384)
WIDTHS = (512, 1024, 2048, 4096, 8192, 16384)
SEQUENCES = (1024, 2048, 4096, 8192, 16384)


def timed(fn, repeats: int, warmup: int = 3, host_lead_cycles: int = 0) -> float:
    """Median seconds of `fn` over `repeats` CUDA-event timings. A `fn` of many launches (an
    optimizer step over hundreds of tensors) would time its host's launches from an empty queue:
    `host_lead_cycles` holds the GPU in a spin kernel that long first, so that the host has
    queued `fn` before its timing starts."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():   # a CPU smoke run of a benchmark: the host's clock
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if host_lead_cycles:
            torch.cuda._sleep(host_lead_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def sweep_gemms(repeats: int, widths: tuple[int, ...]) -> list[dict]:
    results = []
    for m in TOKENS:
        for n in widths:
            for k in widths:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
                seconds = timed(lambda: torch.matmul(a, b), repeats)
                results.append({"m": m, "n": n, "k": k, "tflops": 2 * m * n * k / seconds / 1e12})
    return results


def attention_step(seq: int, dropout: float):
    batch, heads, dim = max(1, 16384 // seq), 16, 128
    shape = (batch, heads, seq, dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        out.backward(grad)

    flops = 3.5 * 2 * batch * seq * seq * heads * dim
    return step, flops


def sweep_attention(repeats: int) -> tuple[list[dict], float]:
    results, slowdowns = [], []
    for seq in SEQUENCES:
        step, flops = attention_step(seq, 0.0)
        seconds = timed(step, repeats)
        results.append({"seq_length": seq, "tflops": flops / seconds / 1e12})
        dropout_step, _ = attention_step(seq, 0.1)
        slowdowns.append(timed(dropout_step, repeats) / seconds)
    return results, statistics.median(slowdowns)


def copy_bandwidth(repeats: int) -> float:
    source = torch.empty(2**31, device="cuda", dtype=torch.int16)  # 4 GiB
    target = torch.empty_like(source)
    seconds = timed(lambda: target.copy_(source), repeats)
    return 2 * source.numel() * 2 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(MEASURED_CURVE), help="JSON to write")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="fewer shapes (a smoke test)")
    args = parser.parse_args()
    started = time.time()
    name = torch.cuda.get_device_name()
    gpu = detect_gpu(name)
    if gpu is None:
        sys.exit(f"bench/gemm.py: unknown GPU '{name}'; add it to tessera/perf/hardware.py")
    widths = WIDTHS[1::2] if args.quick else WIDTHS
    gemms = sweep_gemms(args.repeats, widths)
    attention, dropout_slowdown = sweep_attention(args.repeats)
    measurement = {
        "gpu": name, "torch": torch.__version__, "peak_tflops": gpu.peak_tflops["bf16"],
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "gemm": gemms, "attention": attention, "attention_dropout_slowdown": dropout_slowdown,
        "hbm_gb_per_s": copy_bandwidth(args.repeats), "hbm_datasheet_gb_per_s": gpu.hbm_tb_per_s * 1e3,
    }
    measurement["seconds"] = time.time() - started
    fitted = fit_curves(measurement)
    print(f"{'m':>6} {'n':>6} {'k':>6} {'TFLOP/s':>8} {'model':>8}")
    for point in gemms:
        model = fitted.gemm_efficiency(point["m"], point["n"], point["k"]) * gpu.peak_tflops["bf16"]
        print(f"{point['m']:>6} {point['n']:>6} {point['k']:>6} {point['tflops']:8.1f} {model:8.1f}")
    for point in attention:
        print(f"attention causal fwd+bwd seq {point['seq_length']:>6}: {point['tflops']:6.1f} TFLOP/s "
              f"(model {fitted.attention_efficiency(point['seq_length']) * gpu.peak_tflops['bf16']:.1f})")
    print(f"dropout 0.1 slows attention x{dropout_slowdown:.2f}; HBM copy {measurement['hbm_gb_per_s']:.0f} GB/s")
    print(f"fitted: gemm_max {fitted.gemm_max:.3f}, gemm_k0 {fitted.gemm_k0:.0f}, attn_max {fitted.attn_max:.3f}, "
          f"attn_s0 {fitted.attn_s0:.0f}, hbm_efficiency {fitted.hbm_efficiency:.3f}; {measurement['seconds']:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(measurement, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

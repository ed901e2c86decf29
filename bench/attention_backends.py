"""Forward + backward time of causal SDPA per backend, for MLA's head shapes beside plain ones.

    python bench/attention_backends.py [--seq 4096] [--batch 2] [--heads 16] [--out result.json]

Multi-latent attention (DeepSeek-V2/V3) attends with query/key heads of qk_head_dim +
qk_pos_emb_head_dim = 128 + 64 = 192 and value heads of 128; a plain model of the same
width has 128 everywhere. Each shape runs under every SDPA backend that accepts it (flash,
cuDNN, memory-efficient, math: the ones that refuse a shape are reported as such), bf16,
and the default dispatch (what tessera's attention runs) is timed too, with the kernel it
picked read from the profiler.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gemm import timed   # bench/gemm.py, beside this script

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
SHAPES = {"mla (qk 192, v 128)": (192, 128), "plain (qk 128, v 128)": (128, 128)}


def time_attention(q, k, v, repeats: int = 20) -> float:
    """Milliseconds of one causal forward + backward (the median of `repeats`)."""
    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
        out.backward(torch.ones_like(out))
    return timed(step, repeats) * 1e3


def dispatched_kernel(q, k, v) -> str:
    """The attention kernel the default dispatch launches, by its CUDA kernel name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
    names = [e.key for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return max(names, key=len) if names else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for shape, (qk, v_dim) in SHAPES.items():
        def tensor(dim):
            return torch.randn(args.batch, args.heads, args.seq, dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True)
        q, k, v = tensor(qk), tensor(qk), tensor(v_dim)
        for name, backend in [("default", None), *BACKENDS.items()]:
            row = {"shape": shape, "backend": name, "seq": args.seq, "batch": args.batch, "heads": args.heads}
            try:
                if backend is None:
                    row["kernel"] = dispatched_kernel(q, k, v)
                    row["ms"] = time_attention(q, k, v)
                else:
                    with sdpa_kernel(backend):
                        row["ms"] = time_attention(q, k, v)
            except RuntimeError as error:   # this backend does not take the shape
                row["error"] = str(error).splitlines()[0][:200]
            rows.append(row)
            timing = f"{row['ms']:.3f} ms" if "ms" in row else f"refused: {row['error'][:90]}"
            print(f"RESULT attention {shape:22s} {name:9s} {timing} {row.get('kernel', '')[:80]}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""Bandwidth of one AdamW step over fp32 masters: torch's fused AdamW (+ the copy into bf16
model weights) against tessera's Triton kernel (tessera.kernels.adamw), on one GPU.

    python bench/optimizer_step.py [--params 1e9] [--tensors 64] [--sweep]

--sweep also times the Triton kernel at other block sizes and warp counts.

Bytes per parameter: torch 28 (+ 6 for the copy), Triton 30; GB/s counts those bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemm import timed  # noqa: E402
from tessera.kernels import adamw  # noqa: E402
from tessera.kernels.adamw import MasterAdamW  # noqa: E402

# ~50 ms of GPU spin before each timed step: the host's ~30 us a launch for hundreds of tensors
# fits in it, so that the step is timed on the GPU, as in training, where the host runs ahead.
HOST_LEAD_CYCLES = 80_000_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e9)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    size = int(args.params) // args.tensors
    masters = [torch.randn(size, device="cuda") for _ in range(args.tensors)]
    for m in masters:
        m.grad = torch.randn_like(m)
    models = {m: torch.empty(size, dtype=torch.bfloat16, device="cuda") for m in masters}
    torch_adamw = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def torch_step():
        torch_adamw.step()
        for m, model in models.items():
            model.copy_(m)

    ours = MasterAdamW(masters, models=models, lr=1e-4)
    n = size * args.tensors
    for name, fn, nbytes in (("torch fused AdamW", torch_adamw.step, 28), ("torch fused AdamW + copy", torch_step, 34),
                             ("tessera MasterAdamW", ours.step, 30)):
        seconds = timed(fn, repeats=10, host_lead_cycles=HOST_LEAD_CYCLES)
        print(f"{name:<26} {seconds * 1e3:7.2f} ms  {nbytes * n / seconds / 1e9:6.0f} GB/s", flush=True)
    for block, warps in ((1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)) if args.sweep else ():
        adamw.BLOCK, adamw.NUM_WARPS = block, warps
        seconds = timed(ours.step, repeats=10, host_lead_cycles=HOST_LEAD_CYCLES)
        print(f"  Triton BLOCK {block:5d} warps {warps:2d}  {seconds * 1e3:7.2f} ms  {30 * n / seconds / 1e9:6.0f} GB/s")


if __name__ == "__main__":
    main()

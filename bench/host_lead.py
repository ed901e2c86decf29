"""How far the host runs ahead of the GPU at each phase of a training step, without a profiler
(whose work at every launch slows the host and so makes gaps of its own).

    python bench/host_lead.py --config A [--steps 4] [-- extra tessera flags]

Around each phase (the data, its copy to the GPU, zeroing the gradients, the forward and
backward, the gradient norm, the optimizer step) a CUDA event is recorded beside the host's
clock; after a synchronize, each line gives when the host got there, when the GPU got there,
and the difference: the queued work the GPU has ahead of it. A lead near zero is where the
GPU waits for the host.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import COMMON, CONFIGS  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402


class Marks:
    """(label, host seconds, CUDA event) at each point marked."""

    def __init__(self):
        self.marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(self, label: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.marks.append((label, time.perf_counter(), event))

    def around(self, owner, attribute: str, label: str) -> None:
        """Mark the start and end of every call of owner.attribute."""
        inner = getattr(owner, attribute)

        def marked(*args, **kwargs):
            self.mark(f"{label} start")
            result = inner(*args, **kwargs)
            self.mark(f"{label} end")
            return result

        setattr(owner, attribute, marked)

    def print(self) -> None:
        _, host_zero, gpu_zero = self.marks[0]
        for label, host, event in self.marks:
            host_ms, gpu_ms = (host - host_zero) * 1e3, gpu_zero.elapsed_time(event)
            print(f"  {label:26s} host {host_ms:9.2f} ms  GPU {gpu_ms:9.2f} ms  lead {gpu_ms - host_ms:8.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", choices=sorted(CONFIGS), default="A")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    flags = COMMON + CONFIGS[args.config] + ["--train-iters", str(args.warmup + args.steps)] + args.extra
    trainer = Trainer(parse_run_config(flags, "bench/host_lead.py")[0])
    for _ in range(args.warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    marks = Marks()
    data = trainer.train_data
    trainer.train_data = iter(lambda: (marks.mark("next batch"), next(data))[1], None)
    for owner, attribute, label in [(trainer, "_to_device", "copy to the GPU"),
                                    (trainer.optimizer, "zero_grad", "zero_grad"),
                                    (trainer, "_forward_backward", "forward and backward"),
                                    (trainer.optimizer, "grad_norm", "gradient norm"),
                                    (trainer.optimizer, "step", "optimizer step")]:
        marks.around(owner, attribute, label)
    for _ in range(args.steps):
        marks.mark("step")
        trainer.train_step()
    torch.cuda.synchronize()
    marks.print()


if __name__ == "__main__":
    main()

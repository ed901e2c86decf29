"""Checkpoint save and load time, and size on disk, for the anchors' config A or B.

    python bench/checkpoint.py --config A --dir /tmp/ckpt [--async] [--out result.json] [-- extra tessera flags]
    torchrun --nproc-per-node 2 bench/checkpoint.py --config A --dir /tmp/ckpt -- --use-distributed-optimizer

Trains a few steps, then saves twice (the first save also plans and, with --async, pins its
staging buffers; the second is the steady cost) and loads the newest checkpoint back into
the same trainer. Reported: seconds training is blocked by each save (sync: the whole
write; async: the copy to pinned CPU memory), for async the seconds until the background
write finished and the step time while it ran, the checkpoint's size, and the load time.
Load reads files that were just written: the page cache may hold them (the result says
whether dropping it worked).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_mfu import COMMON, CONFIGS  # noqa: E402
from tessera.cli.args import parse_run_config  # noqa: E402
from tessera.training import checkpoint  # noqa: E402
from tessera.training.checkpoint import iteration_dir  # noqa: E402
from tessera.training.trainer import Trainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="A")
    parser.add_argument("--dir", required=True, help="where checkpoints are written (emptied first)")
    parser.add_argument("--async", dest="async_save", action="store_true", help="--async-save")
    parser.add_argument("--write-threads", type=int, default=checkpoint.WRITE_THREADS,
                        help="files each rank writes in parallel (tessera.training.checkpoint.WRITE_THREADS)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    checkpoint.WRITE_THREADS = args.write_threads
    root = Path(args.dir)
    flags = CONFIGS[args.config] + COMMON + ["--train-iters", "1000", "--save", str(root)] \
        + (["--async-save"] if args.async_save else []) + args.extra
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config, _ = parse_run_config(flags, "bench/checkpoint.py", world_size=world)
    trainer = Trainer(config)
    rank0 = trainer.mesh.rank == 0
    if rank0:
        shutil.rmtree(root, ignore_errors=True)
    _barrier()
    checkpointer = trainer.checkpointer
    step_seconds = _timed_steps(trainer, args.warmup)[-1]
    result = {"config": args.config, "gpus": world, "flags": flags, "async": args.async_save,
              "write_threads": args.write_threads,
              "step_seconds": step_seconds, "saves": []}
    for _ in range(2):
        _synchronize(trainer)
        _barrier()
        start = time.perf_counter()
        checkpointer.save(trainer)
        blocked = time.perf_counter() - start
        save = {"iteration": trainer.iteration, "blocked_seconds": blocked}
        if args.async_save:
            steps = []   # train while the write runs, as the run would
            while _on_any_rank(checkpointer.writing, trainer.device):
                steps += _timed_steps(trainer, 1)
            checkpointer.wait()
            save["write_seconds"] = time.perf_counter() - start
            save["steps_during_write"] = len(steps)
            save["step_seconds_during_write"] = sum(steps) / len(steps) if steps else None
        _barrier()
        save["size_gib"] = _size(iteration_dir(root, save["iteration"])) / 2**30
        result["saves"].append(save)
        trainer.train_step()   # the next save is of another iteration
    result["page_cache_dropped"] = _drop_page_cache() if rank0 else None
    _barrier()
    config.checkpoint.load = str(root)
    _synchronize(trainer)
    start = time.perf_counter()
    checkpointer.load(trainer)
    _synchronize(trainer)
    _barrier()
    result["load_seconds"] = time.perf_counter() - start
    result["loaded_iteration"] = trainer.iteration
    result["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result["torch"] = torch.__version__
    if not rank0:
        return
    mode = "async" if args.async_save else "sync"
    for save in result["saves"]:
        extra = (f", write {save['write_seconds']:.1f} s with {save['steps_during_write']} steps at "
                 f"{save['step_seconds_during_write'] or 0:.3f} s" if args.async_save else "")
        print(f"RESULT checkpoint config {args.config} {world} GPU {mode} {args.write_threads} threads "
              f"save iteration {save['iteration']}: {save['size_gib']:.2f} GiB, "
              f"training blocked {save['blocked_seconds']:.2f} s{extra} (step {step_seconds:.3f} s)", flush=True)
    print(f"RESULT checkpoint config {args.config} {world} GPU load: {result['load_seconds']:.2f} s "
          f"(page cache dropped: {result['page_cache_dropped']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


def _timed_steps(trainer, count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        trainer.train_step()
        _synchronize(trainer)
        seconds.append(time.perf_counter() - start)
    return seconds


def _on_any_rank(flag: bool, device: torch.device) -> bool:
    """Every rank must run the same number of steps: go on while any rank is still writing."""
    if not dist.is_initialized():
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _drop_page_cache() -> bool:
    """Needs root and a writable /proc/sys (the device machine runs as root)."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _synchronize(trainer) -> None:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    main()

"""Run a function in several CPU processes joined by a gloo process group, under pytest.

    results = run_distributed(fn, world_size, *args)   # fn(*args) on every rank; its returns, by rank

`fn` must be defined at module level (the processes find it by import).
An exception on any rank fails the test with that rank's traceback.

Workers fork from one server process that imported torch and tessera once: a spawned worker
spends ~2 s importing them, a forked one ~0.05 s, and the suite starts hundreds of workers.
"""

from __future__ import annotations

import os
import pickle
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import free_port

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "tessera.training.trainer", "tests.dist.equivalence"])


def _worker(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle bytes: tensors sent through the queue as shared memory would vanish
        # when this process exits, before the test reads them.
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 -- report any failure to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    context = _CONTEXT
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, world_size, port, fn, args, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = pickle.loads(value) if status == "ok" else value
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[rank] for rank in range(world_size)]

"""Tensor-parallel `tessera generate` and `tessera serve`: one engine per rank, all in step.

    torchrun --nproc-per-node 2 -m tessera serve --hf HF_DIR --tensor-model-parallel-size 2

Every rank holds its shard of the model and an engine of its own. The engines stay in step
without sharing outputs (tessera.inference.engine): given the same requests in the same
order, every rank schedules, runs and samples the same tokens. So only the requests travel:

- generate: every rank reads the same prompts and runs the same loop; rank 0 writes.
- serve: rank 0 runs HTTP and the engine thread through a `Leader`, which records each add
  and abort its engine accepted and, before each step, broadcasts them to the other ranks;
  those run `follow`: apply the same commands, step, repeat, until the leader's stop.

Commands travel over a gloo group of their own (CPU, whatever the model's backend), with a
timeout long enough for a server that sits idle for days.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from tessera.config import ConfigError
from tessera.parallel.launch import LaunchError, resolve_environment

# The wire format: ("add", request id, prompt ids, SamplingParams), ("abort", request id), ("stop",).
ADD, ABORT, STOP = "add", "abort", "stop"
IDLE_TIMEOUT = timedelta(days=365)


@dataclass
class TensorParallel:
    """This process's place among the tensor-parallel ranks (one model replica over the whole job)."""

    rank: int
    device: str
    control: dist.ProcessGroup     # gloo: commands and agreements, never timing out on an idle server

    @property
    def model_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def broadcast_commands(self, commands: list[tuple] = ()) -> list[tuple]:
        """Rank 0's `commands`, on every rank: a length, then (when not empty) the pickled list."""
        payload = pickle.dumps(list(commands)) if self.rank == 0 and commands else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        if not size.item():
            return []
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return list(commands) if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def agree_on_cache(self, make_engine: Callable[[int | None], object]):
        """`make_engine(num_blocks)` with the smallest rank's default KV cache on every rank.

        On CUDA the default follows each GPU's free memory; ranks with different caches would
        preempt different requests and fall out of step.
        """
        engine = make_engine(None)
        blocks = torch.tensor([engine.cache.num_blocks])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.control)
        if blocks.item() == engine.cache.num_blocks:
            return engine
        del engine   # free its cache before the smaller one is allocated
        return make_engine(int(blocks.item()))

    def leave(self) -> None:
        """Leave together: no rank exits while another still waits for it."""
        dist.barrier(group=self.control)
        dist.destroy_process_group()


def init_tensor_parallel(size: int, device: str, timeout_minutes: float) -> TensorParallel | None:
    """Join torchrun's (or SLURM's) processes as `size` tensor-parallel ranks; None for one process.

    NCCL on CUDA (each rank on its LOCAL_RANK's GPU), gloo on the CPU; model collectives time
    out after `timeout_minutes`. ConfigError when the job's size is not `size`.
    """
    try:
        env = resolve_environment()
    except LaunchError as exc:
        raise ConfigError(str(exc)) from None
    if size != env.world_size:
        raise ConfigError(f"--tensor-model-parallel-size ({size}) must equal the number of processes "
                          f"({env.world_size}, {env.source}): inference runs one model replica, launch it with "
                          f"torchrun --nproc-per-node {size}")
    if size == 1:
        return None
    env.export()
    cuda = device.startswith("cuda")
    if cuda:
        if env.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"rank {env.rank}: LOCAL_RANK {env.local_rank} but this node has "
                              f"{torch.cuda.device_count()} GPUs (--nproc-per-node too large?)")
        device = f"cuda:{env.local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timedelta(minutes=timeout_minutes),
                                device_id=torch.device(device) if cuda else None)
    return TensorParallel(env.rank, device, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


class Leader:
    """Rank 0's engine as the server's engine thread sees it: each add and abort that the
    engine accepted reaches the other ranks before the next step; `serving()` releases them."""

    def __init__(self, engine, parallel: TensorParallel):
        self.engine, self.parallel = engine, parallel
        self.failed = False
        self._applied: list[tuple] = []

    @property
    def max_seq_length(self) -> int:
        return self.engine.max_seq_length

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.engine.eos_token_ids

    def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params)   # a refused one (ValueError) stays here
        self._applied.append((ADD, request_id, list(prompt_token_ids), params))

    def abort_request(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._applied.append((ABORT, request_id))

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list:
        try:
            self._send()
            return self.engine.step()
        except BaseException:
            self.failed = True
            raise

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Around the HTTP server's run; on the way out the other ranks are told to stop.

        uvicorn drains on SIGTERM/SIGINT, then raises the signal again to end the process: the
        handlers here take that second one, so that the stop still reaches the other ranks.
        """
        handled = (signal.SIGTERM, signal.SIGINT)
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
        try:
            yield
        finally:
            for sig in handled:
                signal.signal(sig, previous[sig])
            self._stop()

    def _stop(self) -> None:
        # Not after a failed step: the other ranks may wait inside another collective, and
        # rank 0 exiting non-zero makes torchrun end them.
        if not self.failed:
            self._applied.append((STOP,))
            self._send()

    def _send(self) -> None:
        commands, self._applied = self._applied, []
        self.parallel.broadcast_commands(commands)


def follow(engine, parallel: TensorParallel) -> None:
    """The loop of every rank but 0 under `tessera serve`: rank 0's commands, then a step, until stop.

    SIGTERM and SIGINT (torchrun passes them on; Ctrl-C reaches every rank) are left to rank 0:
    its server drains, then its stop reaches this loop, and the ranks leave together.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        for command in parallel.broadcast_commands():
            if command[0] == STOP:
                return
            if command[0] == ABORT:
                engine.abort_request(command[1])
            else:
                _, request_id, prompt, params = command
                engine.add_request(request_id, prompt, params)   # a refusal here means the ranks diverged
        engine.step()

"""Joining a job: who this process is (torchrun or SLURM), and a checked rendezvous.

torchrun (single- or multi-node, any rendezvous backend) gives each process RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without torchrun, a SLURM step
(`srun python -m tessera train ...`, one task per GPU) gives SLURM_PROCID, SLURM_NTASKS
and SLURM_LOCALID; the address of the first host of SLURM_JOB_NODELIST and a port derived
from the job id stand in for torchrun's.

Before the process group is created, every rank checks in on the rendezvous store
(`join`): its rank, world size, host and a digest of its configuration. That turns the
failures that otherwise hang until PyTorch's default timeout -- a rank that never starts,
nodes launched with different world sizes or flags -- into one clear error on every rank
within --distributed-timeout-minutes. torch.distributed does the rest; this module only
checks and names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from tessera.config.fields import flag

_DEFAULT_PORT = 29500
T = TypeVar("T")


class LaunchError(RuntimeError):
    """The job cannot start as launched; the message names the variable, flag, rank or host."""


@dataclasses.dataclass(frozen=True)
class LaunchEnvironment:
    """This process's place in the job, from torchrun's variables or SLURM's."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = _DEFAULT_PORT
    source: str = "single process"     # "torchrun" (or its variables set by hand), "SLURM", "single process"

    def export(self, environ: dict = os.environ) -> None:
        """Set torchrun's variables (what torch.distributed and the rest of tessera read)."""
        if self.world_size > 1:
            environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                           MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def resolve_environment(environ: Mapping[str, str] = os.environ) -> LaunchEnvironment:
    """torchrun's variables if set (also under SLURM: srun launching torchrun), else SLURM's, else one process."""
    if "WORLD_SIZE" in environ:
        return _checked(LaunchEnvironment(
            rank=_integer(environ, "RANK", 0), world_size=_integer(environ, "WORLD_SIZE"),
            local_rank=_integer(environ, "LOCAL_RANK", 0), master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_integer(environ, "MASTER_PORT", _DEFAULT_PORT), source="torchrun"), "RANK", "WORLD_SIZE")
    if "SLURM_PROCID" in environ:
        if "SLURM_JOB_NODELIST" not in environ and "MASTER_ADDR" not in environ:
            raise LaunchError("SLURM_PROCID is set but neither SLURM_JOB_NODELIST nor MASTER_ADDR is: "
                              "launch with srun inside an allocation, or set MASTER_ADDR")
        job_id = _integer(environ, "SLURM_JOB_ID", 0)
        return _checked(LaunchEnvironment(
            rank=_integer(environ, "SLURM_PROCID"), world_size=_integer(environ, "SLURM_NTASKS", 1),
            local_rank=_integer(environ, "SLURM_LOCALID", 0),
            master_addr=environ.get("MASTER_ADDR") or first_host(environ["SLURM_JOB_NODELIST"]),
            # One port per job, so that two jobs sharing a first node do not collide.
            master_port=_integer(environ, "MASTER_PORT", 20000 + job_id % 20000), source="SLURM"),
            "SLURM_PROCID", "SLURM_NTASKS")
    return LaunchEnvironment()


def job_world_size() -> int:
    """How many processes the job that runs this one has: the initialised process group's, else
    the launcher's (torchrun's or SLURM's), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return resolve_environment().world_size


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[003-005,9],login1' -> 'gpu003'."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # commas outside brackets separate names
    if not first:
        raise LaunchError(f"SLURM_JOB_NODELIST is empty ({nodelist!r})")
    return re.sub(r"\[([^\],-]+)[^\]]*\]", lambda m: m.group(1), first)


def _integer(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None or text == "":
        if default is None:
            raise LaunchError(f"{name} is not set")
        return default
    try:
        return int(text)
    except ValueError:
        raise LaunchError(f"{name} must be an integer, got {text!r}") from None


def _checked(env: LaunchEnvironment, rank_name: str, size_name: str) -> LaunchEnvironment:
    if env.world_size < 1:
        raise LaunchError(f"{size_name} must be >= 1, got {env.world_size}")
    if not 0 <= env.rank < env.world_size:
        raise LaunchError(f"{rank_name} {env.rank} is outside [0, {size_name} {env.world_size}): "
                          "a node rank or --nnodes that does not match the other nodes?")
    return env


def config_fingerprint(config: Any) -> dict:
    """What ranks compare at the rendezvous: every section's flags but local paths (per_node)."""
    sections = {}
    for field in dataclasses.fields(config):
        section = getattr(config, field.name)
        if dataclasses.is_dataclass(section):
            sections[field.name] = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                                    if not f.metadata.get("per_node")}
    return json.loads(json.dumps(sections, sort_keys=True, default=str))


def init_distributed(device: torch.device, config: Any) -> torch.device:
    """Join the job this process belongs to (if any) and pick this rank's device.

    NCCL on CUDA, gloo on CPU; the timeout is --distributed-timeout-minutes.
    """
    env = resolve_environment()
    if dist.is_initialized():
        return device
    if env.world_size == 1:
        if config.parallel.use_torch_fsdp2:   # FSDP2 shards over a DeviceMesh, which needs a group, of one here
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, device_id=device if device.type == "cuda" else None)
        return device
    if device.type == "cuda":
        if env.local_rank >= torch.cuda.device_count():
            raise LaunchError(f"rank {env.rank}: LOCAL_RANK {env.local_rank} but this node has "
                              f"{torch.cuda.device_count()} GPUs (--nproc-per-node or tasks per node too large?)")
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    timeout = timedelta(minutes=config.parallel.distributed_timeout_minutes)
    join(env, backend="nccl" if device.type == "cuda" else "gloo", timeout=timeout, config=config,
         device=device if device.type == "cuda" else None)
    return device


def join(env: LaunchEnvironment, *, backend: str, timeout: timedelta, config: Any,
         device: torch.device | None = None) -> None:
    """Check in with every other rank, then create the default process group.

    Raises LaunchError on every rank, within `timeout`, when a rank does not arrive, when
    ranks disagree on the world size or the configuration, or when the endpoint is unreachable.
    """
    store = _open_store(env, timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives a restart
    prefixed = dist.PrefixStore(f"tessera/{attempt}/", store)
    _Rendezvous(prefixed, env, timeout, config_fingerprint(config)).check_in()
    dist.init_process_group(backend, store=dist.PrefixStore(f"tessera/{attempt}/pg/", store), rank=env.rank,
                            world_size=env.world_size, timeout=timeout, device_id=device)


def _open_store(env: LaunchEnvironment, timeout: timedelta) -> dist.Store:
    # Under torchrun the agent already serves a store at MASTER_ADDR:MASTER_PORT; else rank 0 does.
    serve = env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    endpoint = f"{env.master_addr}:{env.master_port} (MASTER_ADDR:MASTER_PORT, from {env.source})"
    try:
        return dist.TCPStore(env.master_addr, env.master_port, is_master=serve, timeout=timeout,
                             wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as exc:
        action = "serve the rendezvous on" if serve else "reach the rendezvous endpoint"
        raise LaunchError(f"rank {env.rank} cannot {action} {endpoint} within {_minutes(timeout)} "
                          f"(--distributed-timeout-minutes): {_first_line(exc)}") from None


class _Rendezvous:
    """The check-in protocol on the store, keyed by rank.

    Each rank writes its record; ranks other than 0 compare theirs with rank 0's and, on a
    mismatch, post a failure that every other rank reports too. The last rank to arrive
    posts `complete`; rank 0 posts the missing ranks when the timeout passes. Rank 0 serves
    the store, so it leaves last: only after the others have read a failure.
    """

    def __init__(self, store: dist.Store, env: LaunchEnvironment, timeout: timedelta, fingerprint: dict):
        self.store, self.env, self.timeout = store, env, timeout
        self.fingerprint = fingerprint
        self.digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.deadline = time.monotonic() + timeout.total_seconds()

    def check_in(self) -> None:
        try:
            self._check_in()
        except dist.DistNetworkError as exc:   # rank 0, which serves the store, is gone
            raise LaunchError(f"rank {self.env.rank} lost the rendezvous store at {self.env.master_addr}:"
                              f"{self.env.master_port}: did rank 0 exit? ({_first_line(exc)})") from None

    def _check_in(self) -> None:
        env, store = self.env, self.store
        record = {"world_size": env.world_size, "host": socket.gethostname(), "digest": self.digest}
        if env.rank == 0:
            record["config"] = self.fingerprint
        store.set(f"rank/{env.rank}", json.dumps(record))
        store.add("arrived", 1)
        if env.rank != 0:
            problem = self._disagreement(json.loads(self._get("rank/0")), record)
            if problem:
                self._fail(problem)
        if store.add("checked", 1) == env.world_size:
            store.set("complete", "1")
        pause = 0.01
        while not store.check(["complete"]):
            if store.check(["failed"]):
                self._fail(store.get("failed").decode(), posted=True)
            # Rank 0 names the missing ranks; the others wait a little longer for its word.
            if time.monotonic() > self.deadline + (0 if env.rank == 0 else 5):
                self._fail(self._missing())
            time.sleep(pause)
            pause = min(2 * pause, 1.0)   # a thousand ranks must not flood rank 0's store

    def _disagreement(self, first: dict, mine: dict) -> str | None:
        where = f"rank {self.env.rank} (host {mine['host']})"
        if first["world_size"] != mine["world_size"]:
            return (f"{where} was launched with world size {mine['world_size']} but rank 0 (host {first['host']}) "
                    f"with {first['world_size']}: every node needs the same --nnodes x --nproc-per-node "
                    "(or SLURM_NTASKS / WORLD_SIZE)")
        if first["digest"] != mine["digest"]:
            return f"{where} was started with other flags than rank 0 (host {first['host']}): " + \
                "; ".join(_differences(first["config"], self.fingerprint))
        return None

    def _missing(self) -> str:
        absent = [r for r in range(self.env.world_size) if not self.store.check([f"rank/{r}"])]
        shown = ", ".join(map(str, absent[:16])) + (" ..." if len(absent) > 16 else "")
        return (f"rank(s) {shown} of {self.env.world_size} did not join within {_minutes(self.timeout)} "
                "(--distributed-timeout-minutes): a node not started, or started with another rendezvous endpoint")

    def _get(self, key: str) -> str:
        try:
            return self.store.get(key).decode()   # waits up to the store's timeout
        except RuntimeError:
            raise LaunchError(f"rank {self.env.rank}: rank 0 did not check in within {_minutes(self.timeout)} "
                              "(--distributed-timeout-minutes)") from None

    def _fail(self, message: str, posted: bool = False) -> None:
        store = self.store
        if not posted:
            store.compare_set("failed", "", message)   # the first failure wins; the others report it
            message = store.get("failed").decode()
        store.add("failures_seen", 1)
        if self.env.rank == 0:   # keep serving until every rank that arrived has read it (bounded)
            give_up = time.monotonic() + 10
            while store.add("failures_seen", 0) < store.add("arrived", 0) and time.monotonic() < give_up:
                time.sleep(0.05)
        raise LaunchError(message)


def _differences(first: dict, mine: dict) -> list[str]:
    shown = []
    for section, fields in mine.items():
        for name, value in fields.items():
            theirs = first.get(section, {}).get(name)
            if theirs != value:
                shown.append(f"{flag(name)}: {value!r} here, {theirs!r} on rank 0")
    return shown[:5] or ["configuration sections differ"]


def build_in_turns(build: Callable[[], T]) -> T:
    """build() on rank 0, then on each node's first rank, then everywhere, with barriers between.

    For builders that cache their result on disk (the dataset indices): on a shared
    filesystem rank 0 builds and every other rank only reads its files; with a node-local
    cache each node's first rank builds that node's copy. Nobody builds what is already there.
    """
    if not dist.is_initialized():
        return build()
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    result = build() if rank == 0 else None
    dist.barrier()
    if rank != 0 and local_rank == 0:
        result = build()
    dist.barrier()
    return build() if result is None else result


def _minutes(timeout: timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min"


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__

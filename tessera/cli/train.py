"""`tessera train`: parse Megatron-style flags and run the trainer."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import typing

from tessera.cli.args import fail, parse_run_config
from tessera.cli.megatron_flags import ignored_note
from tessera.config import ConfigError

PROG = "tessera train"


def print_schedule(config) -> None:
    """--print-schedule: every pipeline rank's action list, from the config alone (no model)."""
    from tessera.parallel.pipeline_schedules import build_schedule

    parallel = config.parallel
    if parallel.pipeline_model_parallel_size == 1:
        print("no pipeline parallelism (--pipeline-model-parallel-size 1): no schedule")
        return
    schedule = build_schedule(parallel.pipeline_schedule, parallel.pipeline_model_parallel_size,
                              config.num_micro_batches, parallel.virtual_pipeline_size(config.model.num_layers),
                              overlap_p2p=parallel.overlap_p2p_communication)
    print(schedule.format())


def main(argv: list[str]) -> int:
    from tessera.parallel.launch import LaunchError, resolve_environment

    try:
        launch = resolve_environment()   # torchrun's variables, or SLURM's
    except LaunchError as exc:
        fail(PROG, str(exc))
    launch.export()
    # The ranks of a node run the same command line: its errors are printed by the node's first rank
    # alone (each node's, since nodes may be launched with different flags).
    with contextlib.redirect_stderr(io.StringIO()) if launch.local_rank else contextlib.nullcontext():
        config, namespace = parse_run_config(argv, PROG, world_size=launch.world_size)
    note = ignored_note(namespace)
    if note and launch.rank == 0:
        print(f"{PROG}: {note}", flush=True)
    if config.parallel.print_schedule:
        if launch.rank == 0:
            try:
                print_schedule(config)
            except ConfigError as exc:
                fail(PROG, str(exc))
        return 0
    from tessera.training.trainer import Trainer  # after parsing: `--help` stays fast

    trainer = None
    try:
        trainer = Trainer(config)
        trainer.train()
    except (ConfigError, LaunchError) as exc:
        _fail_once(str(exc))
    except RuntimeError as exc:
        if trainer is not None and launch.world_size > 1 and _timed_out(exc):
            trainer.metrics.close()
            fail(PROG, f"rank {launch.rank}: a collective did not complete within --distributed-timeout-minutes "
                       f"({config.parallel.distributed_timeout_minutes:g}) at iteration {trainer.iteration + 1}: "
                       f"another rank hung or died ({str(exc).strip().splitlines()[0]})", skip_teardown=True)
        raise
    _leave_process_group()
    return 0


def _fail_once(message: str) -> typing.NoReturn:
    """Exit with code 2, the message printed by the first rank of the job to find it (the others
    found the same problem, or learn of it when their collectives fail)."""
    import torch.distributed as dist

    from tessera.parallel.report import first_to_report

    joined = dist.is_available() and dist.is_initialized()   # then leave without gloo's teardown (see fail)
    if first_to_report(message):
        fail(PROG, message, skip_teardown=joined)
    if joined:
        sys.stdout.flush()
        os._exit(2)
    sys.exit(2)


def _timed_out(exc: RuntimeError) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _leave_process_group() -> None:
    """Shut the process groups down before the interpreter does: left to exit, a rank can
    abort in gloo's teardown ("terminate called without an active exception", 1 run in 8 of
    tests/dist/test_torchrun.py with the MoE-era mesh's extra groups)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()   # no rank leaves while another still waits for it
        dist.destroy_process_group()

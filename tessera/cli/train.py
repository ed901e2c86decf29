"""`tessera train`: parse Megatron-style flags and run the trainer."""

from __future__ import annotations

import contextlib
import io

from tessera.cli.args import fail, parse_run_config
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
        config, _ = parse_run_config(argv, PROG, world_size=launch.world_size)
    if config.parallel.print_schedule:
        if launch.rank == 0:
            try:
                print_schedule(config)
            except ConfigError as exc:
                fail(PROG, str(exc))
        return 0
    from tessera.training.trainer import Trainer  # after parsing: `--help` stays fast

    try:
        trainer = Trainer(config)
    except (ConfigError, LaunchError) as exc:
        fail(PROG, str(exc))
    try:
        trainer.train()
    except RuntimeError as exc:
        if launch.world_size > 1 and _timed_out(exc):
            trainer.metrics.close()
            fail(PROG, f"rank {launch.rank}: a collective did not complete within --distributed-timeout-minutes "
                       f"({config.parallel.distributed_timeout_minutes:g}) at iteration {trainer.iteration + 1}: "
                       f"another rank hung or died ({str(exc).strip().splitlines()[0]})", skip_teardown=True)
        raise
    _leave_process_group()
    return 0


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

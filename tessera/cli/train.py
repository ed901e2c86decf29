"""`tessera train`: parse Megatron-style flags and run the trainer."""

from __future__ import annotations

import os

from tessera.cli.args import fail, parse_run_config
from tessera.config import ConfigError

PROG = "tessera train"


def main(argv: list[str]) -> int:
    config, _ = parse_run_config(argv, PROG, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    from tessera.training.trainer import Trainer  # after parsing: `--help` stays fast

    try:
        trainer = Trainer(config)
    except ConfigError as exc:
        fail(PROG, str(exc))
    trainer.train()
    return 0

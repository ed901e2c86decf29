"""Whether `tessera train` runs a layout: its own config, built from the settings the plan prints.

The planner keeps no copy of the trainer's rules (which overlaps combine, what FP8 refuses,
what context parallelism asks of the model): it builds the trainer's RunConfig from
Layout.train_settings, the mapping its printed flags come from, and lets that config raise
its ConfigError, naming the flag, as `tessera train` would.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from tessera.config import SECTIONS, ModelConfig, RunConfig

if TYPE_CHECKING:
    from tessera.perf.layout import Layout


@functools.cache
def _section_of() -> dict[str, str]:
    """Config field name -> the RunConfig section that holds it."""
    return {field.name: section for section, cls in SECTIONS.items() for field in dataclasses.fields(cls)}


def trainer_config(model: ModelConfig, layout: "Layout", global_batch_size: int) -> RunConfig:
    """The RunConfig `tessera train <layout's flags> --global-batch-size N` builds on layout.gpus
    ranks (a nominal learning rate and length: the plan sets neither); raises its ConfigError."""
    values = {section: {} for section in SECTIONS}
    # A dense model's expert flags too, if set, for the trainer to refuse.
    for name, value in layout.train_settings(moe=model.num_experts is not None or layout.ep > 1).items():
        values[_section_of()[name]][name] = value
    # Plans are GPU runs, where tessera train compiles unless --no-compile says otherwise.
    values["train"].update(train_iters=1, global_batch_size=global_batch_size, compile=layout.compiled)
    values["optim"].setdefault("lr", 1e-4)
    sections = {section: SECTIONS[section](**values[section]) if values[section] else _defaults(section)
                for section in SECTIONS if section != "model"}
    return RunConfig(model=model, **sections, world_size=layout.gpus)


@functools.cache
def _defaults(section: str):
    """A section the layout sets nothing of (data, checkpoints), made once: RunConfig only reads it."""
    return SECTIONS[section]()

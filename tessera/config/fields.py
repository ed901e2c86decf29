"""What every config section is made of: fields that are flags, and one-line errors."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A bad or inconsistent setting; the message names the flag(s) involved."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option(default: Any, help: str, choices: tuple | None = None, *, secret: bool = False, **metadata: Any) -> Any:
    """A config field with its --help text (and allowed values) for the CLI.

    `group` in the metadata puts the flag under its own heading in --help (the MoE flags of
    ModelConfig); `parse` converts the command-line or YAML text (e.g. a layer pattern);
    `per_node=True` marks a local path that may differ between nodes of one job (the
    start-up check that every rank got the same flags skips it); `repeat=True` makes a list
    flag take one value per use (--stop A --stop B) rather than several after one; `metavar`
    names the value in --help. `secret=True` keeps the value out of the dataclass's repr
    (API keys).
    """
    metadata = {"help": help, "choices": choices, **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata, repr=not secret)
    return field(default=default, metadata=metadata, repr=not secret)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(value is None or value > 0, f"{flag(name)} must be positive, got {value}")

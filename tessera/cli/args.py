"""Command-line and YAML parsing for the config dataclasses in `tessera.config`.

One flag per dataclass field (Megatron-LM names), grouped in --help by section. Values
are layered: defaults < --model PRESET < --config YAML < flags given on the command line.
Any error -- unknown flag or key, bad value, inconsistent combination -- is one line
that names the flag, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

from tessera.cli.megatron_flags import add_megatron_flags, check_aliases
from tessera.config import SECTIONS, ConfigError, RunConfig, flag


class OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line, with a suggestion for a mistyped flag."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            unknown = message.split(":", 1)[1].split()
            known = [s for action in self._actions for s in action.option_strings]
            hints = []
            for arg in unknown:
                if arg.startswith("--"):
                    close = difflib.get_close_matches(arg.split("=")[0], known, n=1)
                    if close:
                        hints.append(f"{arg} (did you mean {close[0]}?)")
                        continue
                hints.append(arg)
            message = "unrecognized arguments: " + ", ".join(hints)
        self.exit(2, f"{self.prog}: error: {message}\n")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A dataclass's resolved annotations, once: resolving them was most of building a parser."""
    return typing.get_type_hints(cls)


def _field_type(cls: type, field: dataclasses.Field) -> tuple[type, bool]:
    """(base type, is a list) of a field annotated `int`, `int | None`, `list[str]`..."""
    hint = _type_hints(cls)[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def add_section(parser: argparse.ArgumentParser, section: str, cls: type) -> None:
    groups = {None: parser.add_argument_group(f"{section} ({cls.__doc__.splitlines()[0].rstrip('.')})")}
    for field in dataclasses.fields(cls):
        heading = field.metadata.get("group")
        if heading not in groups:
            groups[heading] = parser.add_argument_group(f"{section} ({heading})")
        group = groups[heading]
        base, is_list = _field_type(cls, field)
        help_text = field.metadata.get("help", "")
        if field.default is not None and field.default is not dataclasses.MISSING and base is not bool:
            help_text += f" [{field.default}]"
        kwargs: dict[str, Any] = dict(dest=f"{section}.{field.name}", default=argparse.SUPPRESS, help=help_text)
        if base is bool and field.default is None:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=field.metadata.get("parse", base), choices=field.metadata.get("choices"),
                          metavar=field.metadata.get("metavar", field.name.upper()))
            if field.metadata.get("choices") and "metavar" not in field.metadata:
                kwargs["metavar"] = "{" + ",".join(map(str, field.metadata["choices"])) + "}"
            if is_list and field.metadata.get("repeat"):   # --stop A --stop B, as argparse's append
                kwargs["action"] = "append"
            elif is_list:
                kwargs["nargs"] = "+"
        group.add_argument(flag(field.name), **kwargs)


def build_parser(prog: str, sections: Iterable[str], description: str = "",
                 add_extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", metavar="YAML", help="YAML file of settings (keys are flag names)")
    parser.add_argument("--model", metavar="PRESET", help="named architecture (see tessera.models.presets)")
    if add_extra is not None:
        add_extra(parser)
    for section in sections:
        add_section(parser, section, SECTIONS[section])
    add_megatron_flags(parser)
    return parser


def _field_index(sections: Iterable[str]) -> dict[str, str]:
    """field name -> section name."""
    return {f.name: section for section in sections for f in dataclasses.fields(SECTIONS[section])}


def _check_yaml_value(path: str, section: str, name: str, value: Any) -> Any:
    cls = SECTIONS[section]
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    base, is_list = _field_type(cls, field)
    if value is None:
        return None
    if "parse" in field.metadata:
        return field.metadata["parse"](value)
    if is_list:
        value = value if isinstance(value, list) else str(value).split()
        return [base(v) for v in value]
    accepted = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[base]
    if not isinstance(value, accepted) or (base is not bool and isinstance(value, bool)):
        raise ConfigError(f"{path}: {name} ({flag(name)}) must be {base.__name__}, got {value!r}")
    choices = field.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path}: {name} ({flag(name)}) must be one of {', '.join(choices)}, got {value!r}")
    return base(value)


def load_yaml(path: str, sections: Iterable[str]) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """(preset name or None, {section: {field: value}}) from a YAML config file.

    Keys are flag names with `_` or `-`, either flat or nested under a section name.
    """
    sections = list(sections)
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    index = _field_index(sections)
    preset = None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key == "model" and isinstance(value, str):
            preset = value
        elif key in SECTIONS and isinstance(value, dict):
            flat.update({str(k).replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key] = value
    values: dict[str, dict[str, Any]] = {section: {} for section in sections}
    for key, value in flat.items():
        if key not in index:
            close = difflib.get_close_matches(key, index, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{path}: unknown key '{key}'{hint}")
        values[index[key]][key] = _check_yaml_value(path, index[key], key, value)
    return preset, values


def resolve(namespace: argparse.Namespace, sections: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Layer defaults < preset < YAML < command line into {section: {field: value}}."""
    from tessera.models.presets import preset_values

    sections = list(sections)
    yaml_preset, yaml_values = load_yaml(namespace.config, sections) if namespace.config else (None, {})
    preset = namespace.model or yaml_preset
    values: dict[str, dict[str, Any]] = {section: {} for section in sections}
    if preset is not None:
        index = _field_index(sections)
        for key, value in preset_values(preset).items():
            if key in index:
                values[index[key]][key] = value
    for section in sections:
        values[section].update(yaml_values.get(section, {}))
    for dest, value in vars(namespace).items():
        if "." in dest:
            section, name = dest.split(".", 1)
            values[section][name] = value
    return values


def parse_run_config(argv: list[str], prog: str = "tessera train", world_size: int | None = None,
                     add_extra: Callable[[argparse.ArgumentParser], None] | None = None
                     ) -> tuple[RunConfig, argparse.Namespace]:
    """Parse a full training command line; exits with one line naming the flag on error.

    `world_size` defaults to the job's (RunConfig's default): the initialised process group's, else
    the launcher's (torchrun's WORLD_SIZE or SLURM's task count), else 1.
    """
    parser = build_parser(prog, SECTIONS, "Train a decoder-only transformer.", add_extra)
    namespace = parser.parse_args(argv)
    check_aliases(parser, namespace)
    try:
        from tessera.training.pretrained import model_from_checkpoint

        values = resolve(namespace, SECTIONS)
        note = model_from_checkpoint(values)
        parts = {section: SECTIONS[section](**values[section]) for section in SECTIONS}
        config = RunConfig(**parts, world_size=world_size)
        config.notes += [note] if note else []
        return config, namespace
    except ConfigError as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")


def parse_sections(argv: list[str], prog: str, description: str, sections: dict[str, type]) -> dict[str, Any]:
    """One instance of each dataclass in `sections` ({name: class}) from a command line (no YAML, no
    presets: the commands beside `tessera train`); exits with one line naming the flag on error."""
    parser = OneLineParser(prog=prog, description=description, allow_abbrev=False)
    for section, cls in sections.items():
        add_section(parser, section, cls)
    values: dict[str, dict[str, Any]] = {section: {} for section in sections}
    for dest, value in vars(parser.parse_args(argv)).items():
        section, name = dest.split(".", 1)
        values[section][name] = value
    try:
        return {section: cls(**values[section]) for section, cls in sections.items()}
    except ConfigError as exc:
        parser.exit(2, f"{prog}: error: {exc}\n")


def fail(prog: str, message: str, *, skip_teardown: bool = False) -> typing.NoReturn:
    """One line naming the problem, exit code 2. `skip_teardown`: exit at once, without the
    interpreter's shutdown, for when another rank hung: gloo's process-group teardown can then
    abort the process (SIGABRT instead of code 2; 1 run in several of tests/dist/test_launch.py's
    hung-rank test under load)."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    if skip_teardown:
        sys.stdout.flush()
        os._exit(2)
    sys.exit(2)

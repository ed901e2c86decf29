"""docs/flags.md, the flag reference, generated from the parsers the commands build.

Walking the parser of `tessera train` (tessera.cli.args.build_parser) rather than restating
the config dataclasses gives the flags exactly as `--help` spells them: `--x/--no-x` pairs,
headings, value names and choices. Defaults and help come from the dataclass field behind each
flag, the text `--help` shows. Each flag is checked against Megatron-LM's `pretrain_gpt.py`
flag names (megatron_flag_names.txt, read from Megatron-LM's own parser at the commit its first
line names). tests/cli/test_flag_reference.py fails when docs/flags.md differs from this output.

    python -m tessera.cli.flag_reference docs/flags.md     (or: make flags)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from importlib import resources
from typing import Iterable

from tessera.cli.args import add_section, build_parser
from tessera.cli.megatron_flags import ALIASES, IGNORED, UNSUPPORTED
from tessera.config import SECTIONS
from tessera.config.inference import GENERATE_SECTIONS, SERVE_SECTIONS
from tessera.files import atomic_write

REGENERATE = "python -m tessera.cli.flag_reference docs/flags.md"
SAME_AS_MEGATRON = "same as Megatron-LM"
TESSERA_ONLY = "tessera only"
IN_MEGATRON_PARSER = "In Megatron-LM's parser"
# `tessera generate` takes the inference and generate sections, `tessera serve` inference and serve.
INFERENCE_SECTIONS = {**GENERATE_SECTIONS, **SERVE_SECTIONS}
TYPE_NAMES = {int: "int", float: "float", str: "text"}

INTRO = f"""\
# Command-line flags

Every flag of `tessera train`, `tessera generate` and `tessera serve`, by section of the
configuration (`tessera.config`) and by heading of `--help`. This page is generated from the
same dataclasses the commands parse, so it cannot drift from them: after changing a flag, run
`make flags` (`{REGENERATE}`); the test suite
fails until the page is regenerated.

How to read a table:

- **Value**: what the flag takes (`int`, `float`, `text`, a named value or a choice); empty for
  a switch, which takes none.
- **Default**: the value when neither the flag, a `--config` file nor a `--model` preset sets it
  (a preset sets the architecture's flags); `—` means unset, which the help explains.
- **Megatron-LM**: "{SAME_AS_MEGATRON}" when Megatron-LM's `pretrain_gpt.py` has a flag of this
  name, so a Megatron launch script keeps it; "{TESSERA_ONLY}" when it does not; "Megatron-LM has
  `--no-x`" when it has one flag of a `--x`, `--no-x` pair. The names come from Megatron-LM's
  parser (megatron/training/arguments.py, `add_megatron_arguments`) at commit
  `{{commit}}`. In the tables of Megatron-LM's own flags, the last
  column says whether that parser has the flag; those it lacks are older releases' spellings,
  accepted so that older launch scripts run.

The same names are the keys of a `tessera train --config run.yaml` file, with `-` or `_`
(`num-layers: 12` or `num_layers: 12`), either flat or nested under the section's name
(`model:`, `parallel:`, ...). Values are layered: defaults < `--model` preset < `--config`
file < command-line flags.

Megatron-LM's own spellings, the flags it has that tessera accepts and ignores, and the ones
it refuses, are listed after the `tessera train` sections.
"""


@functools.cache
def _megatron_file() -> tuple[str, frozenset[str]]:
    """(Megatron-LM commit, its flag names) from megatron_flag_names.txt."""
    header, *names = resources.files("tessera.cli").joinpath("megatron_flag_names.txt").read_text().splitlines()
    return header.split()[-1], frozenset(names)


def megatron_flag_names() -> frozenset[str]:
    return _megatron_file()[1]


def megatron_equivalence(option_strings: Iterable[str]) -> str:
    option_strings = list(option_strings)
    shared = [name for name in option_strings if name in megatron_flag_names()]
    if shared == option_strings:
        return SAME_AS_MEGATRON
    if not shared:
        return TESSERA_ONLY
    return "Megatron-LM has " + ", ".join(f"`{name}`" for name in shared)   # one of a --x/--no-x pair


def _cell(text: str) -> str:
    """One table cell: argparse's whitespace (one line); pipes, asterisks and angle brackets shown
    as they are, not as Markdown (`4*hidden, or 8/3*hidden` is no emphasis)."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows), ""]


def _field(sections: dict[str, type], dest: str) -> dataclasses.Field | None:
    """The dataclass field behind a parser destination `section.name`; None for --config and --model."""
    section, _, name = dest.partition(".")
    if not name:
        return None
    return next(field for field in dataclasses.fields(sections[section]) if field.name == name)


def _default(field: dataclasses.Field | None) -> str:
    value = None if field is None else (
        field.default_factory() if field.default is dataclasses.MISSING else field.default)
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"   # as --help's "[value]"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices:
        shown = "one of " + ", ".join(f"`{choice}`" for choice in action.choices)
    elif action.metavar == action.dest.partition(".")[2].upper() and action.type in TYPE_NAMES:
        shown = TYPE_NAMES[action.type]   # the type says more than the flag's name in capitals
    else:
        shown = f"`{action.metavar}`"   # a name chosen for it: N, CKPT_DIR, SECONDS
    if action.nargs == "+":
        return shown + ", one or more"
    if isinstance(action, argparse._AppendAction):
        return shown + ", repeatable"
    return shown


def _flag_row(sections: dict[str, type], action: argparse.Action) -> list[str]:
    field = _field(sections, action.dest)
    help_text = action.help if field is None else field.metadata.get("help", "")
    return [", ".join(f"`{name}`" for name in action.option_strings), _value(action), _default(field), help_text,
            megatron_equivalence(action.option_strings)]


def _is_flag(action: argparse.Action) -> bool:
    """A flag of tessera's own: a config field, --config or --model (not --help, nor a Megatron-LM
    spelling, ignored or refused flag, which have no destination)."""
    return bool(action.option_strings) and action.dest not in ("help", argparse.SUPPRESS)


def _section_tables(parser: argparse.ArgumentParser, sections: dict[str, type], general: str = "") -> list[str]:
    """A heading per section, a sub-heading per --help group, a row per flag."""
    lines: list[str] = []
    current = ""   # no section yet; None is the section of --config and --model
    for group in parser._action_groups:
        actions = [action for action in group._group_actions if _is_flag(action)]
        if not actions:
            continue
        section = actions[0].dest.partition(".")[0] if "." in actions[0].dest else None
        if section != current:
            current = section
            lines += [f"### {section} (`{sections[section].__name__}`)" if section else f"### {general}", ""]
        heading = group.title.removeprefix(f"{section} (").removesuffix(")") if section else None
        if heading:
            lines += [f"#### {heading}", ""]
        lines += _table(["Flag", "Value", "Default", "Help", "Megatron-LM"],
                        [_flag_row(sections, action) for action in actions])
    return lines


def _in_megatron(name: str) -> str:
    return "yes" if name in megatron_flag_names() else "no"


def _megatron_tables(parser: argparse.ArgumentParser) -> list[str]:
    known = parser._option_string_actions
    aliases = [[f"`{alias}`", f"`{target}`" + ("" if value is True else f" `{value}`"), _in_megatron(alias)]
               for alias, (target, value) in ALIASES.items() if alias in known]
    ignored = [[f"`{name}`", "`VALUE`" if spec.takes_value else "", spec.reason, _in_megatron(name)]
               for name, spec in IGNORED.items() if name in known]
    refused = [[f"`{name}`", instead, _in_megatron(name)] for name, instead in UNSUPPORTED.items() if name in known]
    return [
        "### Megatron-LM spellings", "",
        "Shorthands and older spellings of Megatron-LM; each sets the tessera flag it means, and giving "
        "both with different values is an error.", "",
        *_table(["Flag", "Sets", IN_MEGATRON_PARSER], aliases),
        "### Megatron-LM flags accepted with no effect", "",
        "Switches between Megatron-LM's and Transformer Engine's kernels, logging backends and profiling "
        "hooks: tessera has one implementation of each. The run starts, with one note naming them.", "",
        *_table(["Flag", "Value", "Why it has no effect", IN_MEGATRON_PARSER], ignored),
        "### Megatron-LM flags refused", "",
        "Megatron-LM features tessera does not have: the run stops with one line saying what to use.", "",
        *_table(["Flag", "Use instead", IN_MEGATRON_PARSER], refused),
    ]


def inference_parser() -> argparse.ArgumentParser:
    """The flags of `tessera generate` and `tessera serve` in one parser, as the commands add them."""
    parser = argparse.ArgumentParser(add_help=False)
    for section, cls in INFERENCE_SECTIONS.items():
        add_section(parser, section, cls)
    return parser


def flag_reference() -> str:
    """docs/flags.md's text."""
    train = build_parser("tessera train", SECTIONS)
    lines = [INTRO.format(commit=_megatron_file()[0]), "## `tessera train`", "",
             *_section_tables(train, SECTIONS, "config file and preset"),
             *_megatron_tables(train),
             "## `tessera generate` and `tessera serve`", "",
             "Both commands take the `inference` flags; `generate`'s are `tessera generate`'s alone and "
             "`serve`'s are `tessera serve`'s. They take no `--config` file.", "",
             *_section_tables(inference_parser(), INFERENCE_SECTIONS)]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {REGENERATE}", file=sys.stderr)
        return 2
    text = flag_reference()
    atomic_write(argv[0], lambda file: file.write(text.encode("utf-8")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

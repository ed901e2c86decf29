"""docs/flags.md is what the generator writes from the parsers of today, and says true things."""

import re
from pathlib import Path

import pytest

from tessera.cli import flag_reference
from tessera.cli.args import build_parser
from tessera.cli.flag_reference import (REGENERATE, SAME_AS_MEGATRON, TESSERA_ONLY, flag_reference as generate,
                                        inference_parser, megatron_equivalence, megatron_flag_names)
from tessera.config import SECTIONS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "flags.md"


@pytest.fixture(scope="module")
def reference() -> str:
    return generate()


def rows(text: str) -> dict[str, list[str]]:
    """First flag of each table row -> the row's cells (escaped pipes stay inside their cell)."""
    cells_of = (re.split(r"(?<!\\)\|", line)[1:-1] for line in text.splitlines() if line.startswith("| `-"))
    return {re.match(r" `(--[^`]+)`", cells[0]).group(1): [cell.strip() for cell in cells] for cells in cells_of}


def test_docs_flags_md_is_up_to_date(reference):
    assert DOCS.read_text() == reference, f"docs/flags.md is stale: run `make flags` or `{REGENERATE}`"


def test_every_flag_of_every_parser_has_a_row(reference):
    listed = set(re.findall(r"`(--[a-z0-9-]+)`", reference))
    for parser in (build_parser("tessera train", SECTIONS), inference_parser()):
        flags = {name for action in parser._actions for name in action.option_strings} - {"-h", "--help"}
        assert flags <= listed, sorted(flags - listed)


def test_megatron_equivalence_is_marked(reference):
    table = rows(reference)
    assert table["--tensor-model-parallel-size"][-1] == SAME_AS_MEGATRON
    assert table["--num-layers"][-1] == SAME_AS_MEGATRON
    assert table["--model"][-1] == TESSERA_ONLY
    assert table["--keep-last"][-1] == TESSERA_ONLY
    assert megatron_equivalence(["--compile", "--no-compile"]) == TESSERA_ONLY
    assert megatron_equivalence(["--check-for-nan-in-loss-and-grad", "--no-check-for-nan-in-loss-and-grad"]) \
        == "Megatron-LM has `--no-check-for-nan-in-loss-and-grad`"


def test_rows_show_defaults_help_and_choices_as_help_does(reference):
    table = rows(reference)
    assert table["--lr-decay-style"][1].startswith("one of `constant`")
    assert table["--make-vocab-size-divisible-by"][1:3] == ["int", "`128`"]
    assert table["--swiglu"][1:3] == ["", "off"]
    help_text = build_parser("tessera train", SECTIONS)._option_string_actions["--seq-length"].help
    assert table["--seq-length"][3] == help_text
    assert table["--recompute-activations"][1:] == ["`--recompute-granularity` `selective`", "yes"]
    assert table["--use-custom-fsdp"][-1] == "no"   # an older release's spelling


def test_megatron_names_come_from_its_parser():
    names = megatron_flag_names()
    assert {"--tensor-model-parallel-size", "--micro-batch-size", "--use-distributed-optimizer", "--bf16",
            "--moe-router-topk", "--no-check-for-nan-in-loss-and-grad"} <= names   # explicit and generated
    assert all(name.startswith("--") for name in names) and len(names) > 800
    assert "--config" not in names and "--keep-last" not in names


def test_main_writes_the_reference(tmp_path, reference):
    target = tmp_path / "flags.md"
    assert flag_reference.main([str(target)]) == 0
    assert target.read_text() == reference
    assert list(tmp_path.iterdir()) == [target]   # no temporary file left behind

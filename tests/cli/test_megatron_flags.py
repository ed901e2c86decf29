"""Megatron-LM's own flags on tessera's command line: its shorthands set what they mean, its
implementation switches are accepted and named once, its missing features are refused in one line."""

import pytest

from tessera.cli.args import build_parser, parse_run_config
from tessera.cli.megatron_flags import IGNORED, ignored_note
from tessera.config import SECTIONS

BASE = ["--model", "tiny-llama", "--mock-data", "--lr", "1e-3", "--train-iters", "2"]


def parse(*flags):
    return parse_run_config([*BASE, *flags], "tessera train", world_size=1)


def error_of(capsys, *flags) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(*flags)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flags, section, name, value", [
    (["--recompute-activations"], "train", "recompute_granularity", "selective"),
    (["--fp8-hybrid", "--bf16"], "train", "fp8_format", "hybrid"),
    (["--fp8-e4m3", "--bf16"], "train", "fp8_format", "e4m3"),
    (["--attention-backend", "fused"], "train", "attention_backend", "cudnn"),
    (["--attention-backend", "unfused"], "train", "attention_backend", "math"),
    (["--attention-backend", "local"], "train", "attention_backend", "math"),
    (["--use-rotary-position-embeddings"], "model", "position_embedding_type", "rope"),
])
def test_megatron_spellings_set_what_they_mean(flags, section, name, value):
    config, _ = parse(*flags)
    assert getattr(getattr(config, section), name) == value


@pytest.mark.parametrize("flags", [
    ["--recompute-activations", "--recompute-granularity", "full"],
    ["--recompute-granularity", "full", "--recompute-activations"],
])
def test_a_spelling_and_its_flag_that_disagree_are_refused(capsys, flags):
    message = error_of(capsys, *flags)
    assert "--recompute-activations means --recompute-granularity selective" in message
    assert "--recompute-granularity full is given too" in message


def test_a_spelling_that_agrees_with_its_flag_is_fine():
    config, _ = parse("--recompute-activations", "--recompute-granularity", "selective")
    assert config.train.recompute_granularity == "selective"


def test_implementation_switches_are_accepted_and_named_once():
    config, namespace = parse("--transformer-impl", "transformer_engine", "--use-mcore-models", "--use-flash-attn",
                              "--no-masked-softmax-fusion", "--no-rope-fusion", "--profile-ranks", "0", "1",
                              "--distributed-backend", "nccl", "--micro-batch-size", "2")
    assert config.train.micro_batch_size == 2       # the values they take do not swallow the next flag
    note = ignored_note(namespace)
    assert config.train.attention_backend == "auto"   # Megatron-Core's --attention-backend decides, as there
    for name in ("--transformer-impl", "--use-mcore-models", "--use-flash-attn", "--no-masked-softmax-fusion",
                 "--no-rope-fusion", "--profile-ranks", "--distributed-backend"):
        assert note.count(name) == 1
    # Flags ignored for one reason are listed together, the reason said once.
    assert note.count(IGNORED["--no-rope-fusion"].reason) == 1
    assert ignored_note(parse()[1]) is None


@pytest.mark.parametrize("flags, expected", [
    (["--recompute-modules", "core_attn"], "--recompute-modules (Megatron-LM) is not supported"),
    (["--rampup-batch-size", "16", "16", "1000"], "--rampup-batch-size (Megatron-LM) is not supported"),
    (["--step-batch-size-schedule", "0:16 1B:32"], "--step-batch-size-schedule (Megatron-LM) is not supported"),
])
def test_missing_megatron_features_are_refused_in_one_line(capsys, flags, expected):
    assert expected in error_of(capsys, *flags)


def test_mistyped_spellings_get_the_right_hint(capsys):
    assert "(did you mean --recompute-activations?)" in error_of(capsys, "--recompute-activation")
    assert "(did you mean --fp8-hybrid?)" in error_of(capsys, "--fp8-hybird")


def test_help_lists_the_spellings():
    text = build_parser("tessera train", SECTIONS).format_help()
    assert "--fp8-hybrid" in text and "Megatron-LM's spelling of --fp8-format hybrid" in text
    assert "--transformer-impl" in text

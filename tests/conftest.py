"""Shared helpers for the tests: tiny run configurations built from command-line flags."""

import os

import pytest

from tessera.cli.args import parse_run_config

os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY = ["--model", "tiny-llama", "--mock-data", "--lr", "3e-3", "--train-iters", "8",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1000",
        "--num-workers", "0"]


def run_config(*flags: str, base: list[str] = TINY):
    """A RunConfig from tiny defaults plus extra flags (later flags win)."""
    config, _ = parse_run_config([*base, *flags])
    return config


@pytest.fixture
def tiny_flags():
    return list(TINY)

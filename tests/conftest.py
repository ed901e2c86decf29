"""Shared helpers for the tests: tiny run configurations built from command-line flags, and the
layers' fused CUDA paths taken on the CPU."""

import contextlib
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


@contextlib.contextmanager
def fused_as_on_gpus():
    """The layers take their fused CUDA paths (the MLP's SwiGLU fused into fc2) through those paths'
    torch code: what the planner models and what GPUs run, checked on the CPU."""
    import tessera.parallel.tensor as tensor

    on_triton = tensor.on_triton
    tensor.on_triton = lambda t: True
    try:
        yield
    finally:
        tensor.on_triton = on_triton

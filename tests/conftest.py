"""Shared helpers for the tests: tiny run configurations built from command-line flags, the
layers' fused CUDA paths taken on the CPU, and FP8 layers on the CPU."""

import contextlib
import os
from unittest import mock

import pytest
import torch

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


@contextlib.contextmanager
def fp8_on_cpu():
    """FP8 layers on the CPU (torch._scaled_mm runs there): the trainer's check for FP8 tensor cores
    is off, and so is oneDNN, whose E4M3 x E4M3 matmul is its reference kernel on some CPUs
    (ONEDNN_VERBOSE=1 says `ref:any`: 100 ms for 256x64 @ 64x176 on an AVX512-FP16 Xeon, torch
    2.13), where PyTorch's own kernel gives the same bits in 0.3 ms."""
    from tessera.training import fp8

    with mock.patch.object(fp8, "check_device", lambda device, recipe: None), \
            torch.backends.mkldnn.flags(enabled=False):
        yield

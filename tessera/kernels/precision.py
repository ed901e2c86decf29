"""Autocast off around a computation whose products must stay in its own precision."""

from __future__ import annotations

import functools

import torch


def without_autocast(function):
    """`function` run with autocast off on the device of its first argument, a tensor. The scans of
    the recurrent mixers keep fp32 states and products: under the trainer's bf16 autocast their
    matrix products would otherwise run in bf16, and the state's error would grow along the sequence."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with torch.autocast(args[0].device.type, enabled=False):
            return function(*args, **kwargs)
    return run

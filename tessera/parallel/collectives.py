"""Flat-tensor collectives under whichever name the running torch gives them.

torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and
reduce_scatter_single and made the old names warn on every process; torch 2.6-2.12 have
only the old names. Output and input are contiguous; ranks' pieces are concatenated along
dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool = False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, *, group, async_op: bool = False):
    """Sum over ranks; each rank receives its 1/size of the result."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)

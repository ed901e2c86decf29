"""--fp8-param-gather: the distributed optimizer gathers the FP8 linears' weights in E4M3.

Without it every rank all-gathers the updated bf16 weights and each FP8 layer casts its weight
to E4M3 in every forward and backward. With it each rank casts only the slices it has just
updated and the ranks all-gather those bytes: half the traffic, and the layers read the
gathered copy (tessera.kernels.fp8.Fp8Gemm) instead of casting. The copy must be exactly what
the layer would have cast, so a scale comes from the whole weight, not a rank's slice: each
rank takes the amax of its slice in every scaling block (the whole tensor for the tensorwise
and delayed recipes, 128x128 blocks for blockwise), the ranks reduce them with MAX in one
all-reduce a step, and every rank derives the same scales from the result.

The FP8 linears' weights get gradient buffers of their own (tessera.training.optimizer), so
that a bucket holds one kind of weight and its gather one dtype. Their bf16 copies are then
current only in the slices a rank owns; whatever needs the whole bf16 weights (the caller of
Trainer.train) asks for them (DistributedOptimizer.gather_model_weights). Checkpoints save
the fp32 masters, as without the flag.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.kernels.fp8 import E4M3
from tessera.kernels.fp8_cast import Slice, WeightSlices, grid
from tessera.parallel.ddp import GradBuffer


class Fp8Weights:
    """One gradient buffer's weights, each an FP8 linear's, in E4M3 and laid out like the buffer;
    their scales in one vector (each weight's grid in turn), as their GEMMs take them."""

    def __init__(self, grads: GradBuffer, layers: dict[nn.Parameter, nn.Module],
                 owned: list[tuple[torch.Tensor, nn.Parameter, int]]):
        """`layers`: each weight's FP8 GEMM module (one recipe for all); `owned`: (bf16 slice,
        weight, flat offset in it) of every slice this rank updates."""
        self.group = grads.group
        device = next(iter(grads.ranges)).device
        self.data = torch.zeros(grads.size, dtype=torch.uint8, device=device)
        self.layers = [layers[param] for param in grads.ranges]   # the same order on every rank
        self.block = self.layers[0].weight_block
        grids = [grid(param.shape, self.block) for param in grads.ranges]
        sizes = [rows * cols for rows, cols in grids]
        self.stored_scales = torch.ones(sum(sizes), device=device)
        first_scale = dict(zip(grads.ranges, [0, *torch.tensor(sizes).cumsum(0).tolist()]))
        for (param, (start, end)), layer, scales, shape in zip(
                grads.ranges.items(), self.layers, self.stored_scales.split(sizes), grids):
            layer.attach_fp8_weight(self.data[start:end].view(E4M3).view(param.shape), scales.view(shape))
        self.slices = WeightSlices([
            Slice(view, self.data[grads.ranges[param][0] + offset:][:view.numel()].view(E4M3), offset, param.shape,
                  self.block, first_scale[param]) for view, param, offset in owned])

    @torch.no_grad()
    def quantize(self) -> None:
        """Cast this rank's slices with the scales of the whole weights (before their gather)."""
        quantize_slices(self.slices, self.layers, self.stored_scales, self.group)


def quantize_slices(slices: WeightSlices, layers: list[nn.Module], stored_scales: torch.Tensor, group) -> None:
    """Cast `slices` with the scales of their whole weights: each rank's amaxes per scaling block,
    their MAX over `group`, the layers' scales from them (stored as the GEMMs take them)."""
    amaxes = torch.zeros_like(stored_scales)
    slices.amax(amaxes)
    if group is not None:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    scales, stored = type(layers[0]).weight_scales(layers, amaxes)
    stored_scales.copy_(stored)
    slices.cast(scales)

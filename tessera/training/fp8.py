"""FP8 training: which GEMMs run in FP8, the checks that need the device, and delayed scaling's step.

The linear layers of the transformer blocks (QKV, attention output, MLP) get an Fp8Linear
(tessera.kernels.fp8) in place of F.linear, and with --fp8-experts the MoE experts FP8 grouped
GEMMs scaled per row (tessera.kernels.fp8_grouped, whatever the recipe); the embedding, the
output layer, the router, norms and attention stay in bf16, as in Megatron and DeepSeek-V3. With
--first-last-layers-bf16 the first and last few blocks (global layer indices, so a
pipeline stage knows its own) stay in bf16 too. The blockwise recipe gets a BlockwiseFp8Linear
(tessera.kernels.fp8_blockwise), whose 128-blocks need every dimension divisible by 128: a
layer that is not is an error naming it, not a silent bf16 fallback, so that a run is FP8 where
its flags say.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import ConfigError, TrainConfig
from tessera.kernels.fp8 import Fp8Linear, Fp8Recipe
from tessera.kernels.fp8_blockwise import BlockwiseFp8Linear
from tessera.models.moe import GroupedExperts
from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear


def recipe_of(train: TrainConfig) -> Fp8Recipe | None:
    if train.fp8_format is None:
        return None
    return Fp8Recipe(format=train.fp8_format, recipe=train.fp8_recipe, margin=train.fp8_margin,
                     amax_history_len=train.fp8_amax_history_len, amax_compute_algo=train.fp8_amax_compute_algo,
                     fp8_wgrad=not train.no_fp8_wgrad, experts=train.fp8_experts)


def check_device(device: torch.device, recipe: Fp8Recipe) -> None:
    """FP8 GEMMs need FP8 tensor cores: Ada or Hopper (compute capability 8.9) and later; cuBLAS's
    block-scaled GEMMs exist on Hopper (9.x) only."""
    if device.type != "cuda":
        raise ConfigError(f"--fp8-format needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9); "
                          f"this run is on {device.type}")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(f"--fp8-format needs FP8 tensor cores (compute capability >= 8.9); "
                          f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    if recipe.recipe == "blockwise" and capability[0] != 9:
        raise ConfigError(f"--fp8-recipe blockwise needs a Hopper GPU (cuBLAS's 1x128 / 128x128 block-scaled "
                          f"GEMMs are SM 9.x only); {torch.cuda.get_device_name(device)} has "
                          f"{capability[0]}.{capability[1]}: use --fp8-recipe tensorwise")


def bf16_layers(train: TrainConfig, num_layers: int) -> set[int]:
    """Global indices of the blocks that --first-last-layers-bf16 keeps out of FP8."""
    if not train.first_last_layers_bf16:
        return set()
    start, end = train.num_layers_at_start_in_bf16, train.num_layers_at_end_in_bf16
    return set(range(min(start, num_layers))) | set(range(max(num_layers - end, 0), num_layers))


def fp8_linear(recipe: Fp8Recipe, device: torch.device | str | None = None) -> nn.Module:
    """The FP8 GEMM of one linear layer for this recipe."""
    return BlockwiseFp8Linear(recipe) if recipe.recipe == "blockwise" else Fp8Linear(recipe, device=device)


def apply_fp8(layers, recipe: Fp8Recipe, keep_bf16: set[int], tokens_per_micro_batch: int) -> list[nn.Module]:
    """Give every linear of the blocks not in `keep_bf16` an Fp8Linear (BlockwiseFp8Linear for the
    blockwise recipe), and their experts FP8 grouped GEMMs if the recipe says; returns the linears'
    FP8 modules.

    `layers` yields (global index, block). FP8 GEMMs need every dimension divisible by 16; blockwise
    ones by 128 (wgrad's tiles run along the tokens).
    """
    blockwise = recipe.recipe == "blockwise"
    align, who = (128, "--fp8-recipe blockwise") if blockwise else (16, "--fp8-format")
    if tokens_per_micro_batch % align:
        raise ConfigError(f"{who}: FP8 GEMMs need the tokens per micro-batch per rank "
                          f"({tokens_per_micro_batch}) divisible by {align} (--micro-batch-size x --seq-length)")
    fp8_layers = []
    for index, block in layers:
        if index in keep_bf16:
            continue
        for name, module in block.named_modules():
            if isinstance(module, GroupedExperts) and recipe.experts:
                for weight_name in ("fc1", "fc2"):
                    _, rows, columns = getattr(module, weight_name).shape
                    if rows % 16 or columns % 16:
                        raise ConfigError(f"--fp8-format: layer {index}'s {name}.{weight_name} has {rows} x {columns} "
                                          f"expert weights on each rank; FP8 grouped GEMMs need both dimensions "
                                          f"divisible by 16 (--hidden-size, --moe-ffn-hidden-size)")
                module.fp8 = recipe
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                rows, columns = module.weight.shape
                if rows % align or columns % align:
                    raise ConfigError(f"{who}: layer {index}'s {name} has a {rows} x {columns} weight on each rank; "
                                      f"FP8 GEMMs need both dimensions divisible by {align}"
                                      + (" (or use --fp8-recipe tensorwise)" if blockwise else ""))
                module.fp8 = fp8_linear(recipe, module.weight.device)
                fp8_layers.append(module.fp8)
    return fp8_layers


def gathered_weights(model: nn.Module) -> dict[nn.Parameter, nn.Module]:
    """--fp8-param-gather: the FP8 linears' weights, each with its FP8 GEMM module. The experts'
    are gathered in bf16: their grouped GEMMs scale the weight per column one way in the forward
    and another in the backward (tessera.kernels.fp8_grouped), two casts that one copy cannot serve."""
    return {module.weight: module.fp8 for module in model.modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.fp8 is not None}


@torch.no_grad()
def end_step(fp8_layers: list[nn.Module], group) -> None:
    """Delayed scaling, once per optimizer step: every rank takes the largest amax any rank
    saw (so that model-parallel shards and data-parallel replicas share scales), then each
    layer updates its history and scales."""
    delayed = [layer for layer in fp8_layers if layer.recipe.recipe == "delayed"]
    if not delayed:
        return
    amaxes = torch.stack([layer.step_amax for layer in delayed])
    if group is not None:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    for layer, amax in zip(delayed, amaxes):
        layer.step_amax = amax
        layer.end_step()

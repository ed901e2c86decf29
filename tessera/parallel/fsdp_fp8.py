"""--fp8-param-gather under FSDP2: the FP8 linears' weights are all-gathered in E4M3.

FSDP2 asks a parameter's local shard how to be gathered when the shard's tensor defines
`fsdp_pre_all_gather` and `fsdp_post_all_gather`. An FP8 linear's weight becomes, before
`fully_shard`, a parameter whose data is a `ShardedFp8Weight`: a wrapper that behaves as its
inner tensor for every op (the optimizer's update, state dicts, checkpoints) and, asked for
the gather, hands over the E4M3 bytes of the shard in place of its values. The gathered
weight is a `GatheredFp8Weight`: the E4M3 weight and its scales, which the layer's GEMMs read
(tessera.kernels.fp8, `Fp8Gemm.gathered`) instead of casting; its gradient is an ordinary one in
the weight's dtype, for FSDP2's reduce-scatter.

The E4M3 bytes must be what the layer would cast from its whole weight, so a scale comes from
the whole weight, not a shard: after every optimizer step (and at the start, and after a
checkpoint load) `Fp8Shards.quantize` takes each shard's amax per scaling block, reduces them
over the data-parallel ranks with MAX in one all-reduce, and casts every shard with the
result (tessera.parallel.fp8_gather, as the distributed optimizer does with its slices). A
gather in the forward and the backward then only sends the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from tessera.kernels.fp8 import E4M3
from tessera.kernels.fp8_cast import Slice, WeightSlices, grid
from tessera.parallel.fp8_gather import quantize_slices

aten = torch.ops.aten
# Ops whose result is new storage that stands for the shard (FSDP2's padded copy of it).
_ALLOCATIONS = {aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
                aten.empty_like.default, aten.zeros_like.default}


@dataclass
class Fp8Shard:
    """A weight's shard in E4M3, padded as FSDP2 pads the shard, and the whole weight's scales
    (one, or one per 128x128 block: as the layer's GEMMs take them)."""

    rows: int                         # of the whole weight
    data: torch.Tensor | None = None   # uint8 (padded shard rows, cols); set by Fp8Shards
    scale: torch.Tensor | None = None


class ShardedFp8Weight(torch.Tensor):
    """A local shard of an FP8 linear's weight: its values for every op; E4M3 for FSDP2's gather."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, fp8: Fp8Shard):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor, fp8: Fp8Shard):
        self.data_ = data
        self.fp8 = fp8

    def __repr__(self) -> str:
        return f"ShardedFp8Weight({self.data_})"

    def __reduce_ex__(self, protocol):   # saved (checkpoints) as its values: a plain tensor
        return self.data_.__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        shard = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, cls))   # also in lists (foreach ops)
        unwrap = lambda t: t.data_ if isinstance(t, cls) else t   # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        returns = func._schema.returns
        alias = returns[0].alias_info if len(returns) == 1 else None
        if alias is not None and alias.is_write:   # in place (or out=): the tensor written, as given
            written = next(i for i, arg in enumerate(func._schema.arguments)
                           if arg.alias_info is not None and arg.alias_info.before_set == alias.before_set)
            return args[written] if written < len(args) else kwargs[func._schema.arguments[written].name]
        if alias is not None or func in _ALLOCATIONS:   # a view of the shard, or FSDP2's padded copy
            return tree_map(lambda t: cls(t, shard.fp8) if isinstance(t, torch.Tensor) else t, out)
        return out   # arithmetic: plain values

    # FSDP2's all-gather extension, in the one-argument form: the only one early FSDP2
    # (torch.distributed._composable.fsdp) calls, and still taken beside the five-argument one.
    # Early FSDP2 also refuses uneven shards (dim 0 not divisible by the ranks) with extensions.
    def fsdp_pre_all_gather(self, mesh):
        return (self.fp8.data,), (self.fp8.scale.clone(),)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: tuple[torch.Tensor, ...],
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        (gathered,), (scale,) = outputs, metadata
        if out is not None:   # a later gather into the same storage: only the scales are new
            out.e4m3_scale = scale   # rebound, not copied into: the forward saved the old one for its backward
            return None
        weight = gathered[:self.fp8.rows].view(E4M3)   # less the padding of the last shards
        return GatheredFp8Weight(weight, scale, param_dtype), (gathered,)


class GatheredFp8Weight(torch.Tensor):
    """An FP8 linear's whole weight as FSDP2 gathered it: E4M3 values and their scales, standing in
    for a weight of `dtype` (its gradient's). Only the layer's FP8 GEMMs read it."""

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, fp8.shape, strides=fp8.stride(),
                                                   storage_offset=fp8.storage_offset(), dtype=dtype,
                                                   device=fp8.device)

    def __init__(self, fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.e4m3, self.e4m3_scale = fp8, scale   # the names tessera.kernels.fp8.Fp8Gemm.gathered reads

    def __repr__(self) -> str:
        return f"GatheredFp8Weight({self.e4m3}, scale={self.e4m3_scale})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weight = args[0]
        if func in (aten.detach.default, aten.alias.default, aten.as_strided.default):   # FSDP2's views
            return cls(func(weight.e4m3, *args[1:], **(kwargs or {})), weight.e4m3_scale, weight.dtype)
        raise NotImplementedError(f"{func} on a weight gathered in E4M3 (--fp8-param-gather with "
                                  f"--use-torch-fsdp2): only its layer's FP8 GEMMs read it")


def wrap_fp8_weights(model: nn.Module, weights) -> None:
    """Before fully_shard: each of `weights` (FP8 linears' weights) becomes a parameter over a
    ShardedFp8Weight, under the same name."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param in weights:
                fp8 = ShardedFp8Weight(param.data, Fp8Shard(rows=param.shape[0]))
                setattr(module, name, nn.Parameter(fp8, requires_grad=param.requires_grad))


class Fp8Shards:
    """Every FP8 linear's FSDP2 shard, cast to E4M3 with the scales of the whole weights."""

    def __init__(self, weights: dict[nn.Parameter, nn.Module], gather_dtype: torch.dtype):
        """`weights`: the FSDP2 (DTensor) parameters over ShardedFp8Weights, each with its FP8 GEMM
        module (one recipe for all); `gather_dtype`: what FSDP2 gathers the other weights in. The
        E4M3 bytes are cast from the shards rounded to it (bf16 under --bf16), as each layer would
        cast such a gathered weight."""
        self.gather_dtype = gather_dtype
        self.params = list(weights)
        self.layers = [weights[param] for param in self.params]
        mesh = self.params[0].device_mesh
        self.group = mesh.get_group(mesh.ndim - 1)   # the shard dimension (HSDP's second)
        self.block = self.layers[0].weight_block
        ranks = self.group.size()
        grids = [grid(param.shape, self.block) for param in self.params]
        sizes = [rows * cols for rows, cols in grids]
        device = self.params[0].device
        self.stored_scales = torch.ones(sum(sizes), device=device)
        self.first_scales = [0, *torch.tensor(sizes).cumsum(0).tolist()][:-1]
        for param, scales, shape in zip(self.params, self.stored_scales.split(sizes), grids):
            rows, cols = param.shape
            fp8 = param.to_local().fp8
            fp8.data = torch.zeros(-(-rows // ranks), cols, dtype=torch.uint8, device=device)   # FSDP2's padding
            fp8.scale = scales.view(shape)
        self._slices, self._shards, self._rounded = None, None, None

    def _current_slices(self) -> WeightSlices:
        """This rank's shards (rounded to the gather dtype) as cast slices; tabled again when FSDP2
        has moved a shard (it pads an uneven one anew at its first forward)."""
        locals_ = [param.to_local() for param in self.params]
        shards = [local.data_ for local in locals_]
        addresses = [shard.data_ptr() for shard in shards]
        if addresses != self._shards:
            self._shards = addresses
            self._rounded = [shard if shard.dtype == self.gather_dtype
                             else torch.empty_like(shard, dtype=self.gather_dtype) for shard in shards]
            self._slices = WeightSlices([
                Slice(source.reshape(-1), local.fp8.data.view(-1)[:source.numel()].view(E4M3),
                      _row_offset(param) * param.shape[1], param.shape, self.block, first)
                for param, local, source, first in zip(self.params, locals_, self._rounded, self.first_scales)
                if source.numel()])
        copies = [(rounded, shard) for rounded, shard in zip(self._rounded, shards) if rounded is not shard]
        if copies:   # one launch rounds them all
            torch._foreach_copy_([rounded for rounded, _ in copies], [shard for _, shard in copies])
        return self._slices

    @torch.no_grad()
    def quantize(self) -> None:
        quantize_slices(self._current_slices(), self.layers, self.stored_scales, self.group)


def _row_offset(param: nn.Parameter) -> int:
    """The first row of this rank's FSDP2 shard (FSDP2 cuts dim 0)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, origin = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return origin[0]

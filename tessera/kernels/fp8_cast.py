"""Slices of weights cast to E4M3, each element scaled by its weight's scale (one for the
whole tensor, or one per 128x128 block): the distributed optimizer's cast under
--fp8-param-gather (tessera.parallel.fp8_gather).

A slice is a flat range [offset, offset + n) of a (rows, cols) weight, in its bf16 copy, and
goes to an E4M3 view of the same length. On CUDA one Triton launch casts every slice, and one
more finds the amaxes of 128x128 blocks (one program a block a slice touches; per-tensor
amaxes are torch._foreach_norm's): a weight's slices and scales never move, so their
addresses are tabled once, and a step's ~100 weights need no launches each (the eager ops took
~12 launches a weight, 4.7% of config B's FP8 step on an H200). The cast is quantize()'s:
x x scale, saturated to +-448, rounded to nearest even; elsewhere (CPU, and fp32 weights: FSDP2's
without --bf16) it runs in those torch ops, slice by slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.kernels.fp8 import E4M3, FP8_MAX, quantize
from tessera.kernels.sum_of_squares import chunk_programs

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

BLOCK, CHUNK = 1024, 16384   # elements a load, a program


@dataclass(frozen=True)
class Slice:
    source: torch.Tensor      # the slice's bf16 values (flat)
    target: torch.Tensor      # where its E4M3 values go (flat, E4M3)
    offset: int               # of the slice's first element in the weight
    shape: torch.Size         # the weight's (rows, cols)
    block: int | None         # scaling blocks: None for one scale, else square blocks of this size
    first_scale: int          # index of the weight's first scale in the scales vector


def grid(shape: torch.Size, block: int | None) -> tuple[int, int]:
    """A weight's scaling blocks along each dimension."""
    rows, cols = shape
    return (1, 1) if block is None else (rows // block, cols // block)


class WeightSlices:
    """Fixed slices of weights, cast into fixed E4M3 views: `amax(into)` writes each slice's
    amax per scaling block into the scales vector's layout, `cast(scales)` casts every slice
    with its weight's scales (each weight's grid row-major, from its `first_scale`)."""

    def __init__(self, slices: list[Slice]):
        self.slices = slices
        self.block = slices[0].block if slices else None   # one recipe for all
        self._first_scales = torch.tensor([s.first_scale for s in slices], dtype=torch.int64,
                                          device=slices[0].source.device if slices else None)
        self._programs = None
        # The kernels read bf16 weights; fp32 ones (FSDP2 without --bf16) take the torch ops.
        if slices and triton is not None and slices[0].source.is_cuda and slices[0].source.dtype == torch.bfloat16:
            self._table, self._programs = _tables(slices)
            if self.block is not None:
                self._blocks = _block_programs(slices).to(slices[0].source.device)

    def amax(self, into: torch.Tensor) -> None:
        if not self.slices:
            return
        if self.block is None:   # one scale a weight: every slice's amax in one pass
            maxima = torch._foreach_norm([s.source for s in self.slices], float("inf"), dtype=torch.float32)
            into.index_copy_(0, self._first_scales, torch.stack(maxima))
        elif self._programs is not None:
            _block_amax_kernel[(self._blocks.shape[1],)](self._table, self._blocks, into, self._blocks.shape[1],
                                                         BLOCK=self.block, num_warps=8)
        else:
            for s in self.slices:
                amax = slice_amax(s.source, s.offset, s.shape, s.block).flatten()
                into[s.first_scale:s.first_scale + amax.numel()] = amax

    def cast(self, scales: torch.Tensor) -> None:
        if self._programs is None:
            for s in self.slices:
                count = grid(s.shape, s.block)
                s.target.copy_(quantize_slice(s.source, s.offset, s.shape, s.block,
                                              scales[s.first_scale:s.first_scale + count[0] * count[1]].view(count)))
            return
        _cast_kernel[(self._programs.shape[1],)](self._table, self._programs, scales, self._programs.shape[1],
                                                 LIMIT=FP8_MAX[E4M3], BLOCK=BLOCK, CHUNK=CHUNK)


def _tables(slices: list[Slice]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per slice: source and target addresses, length, offset, columns, block (0: one scale) and
    first scale; per program: its slice and chunk."""
    table = torch.tensor([(s.source.data_ptr(), s.target.data_ptr(), s.source.numel(), s.offset, s.shape[1],
                           s.block or 0, s.first_scale) for s in slices], dtype=torch.int64)
    device = slices[0].source.device
    return table.to(device), chunk_programs([s.source.numel() for s in slices], CHUNK).to(device)


def _block_programs(slices: list[Slice]) -> torch.Tensor:
    """Per program of the block amax: its slice, and the row and column of a block the slice touches."""
    programs = []
    for index, s in enumerate(slices):
        width = s.shape[1]
        first, last = s.offset // width // s.block, (s.offset + s.source.numel() - 1) // width // s.block
        programs += [(index, row, col) for row in range(first, last + 1) for col in range(width // s.block)]
    return torch.tensor(programs, dtype=torch.int64).t().contiguous()


def slice_amax(flat: torch.Tensor, offset: int, shape: torch.Size, block: int | None) -> torch.Tensor:
    """The amax of the elements [offset, offset + flat.numel()) of a weight of `shape`, per
    scaling block (an fp32 grid, 0 where the slice has none of a block's elements)."""
    if block is None:
        return flat.abs().amax().float().reshape(1, 1)
    region, first = _block_rows(flat, offset, shape, block)
    rows, cols = shape
    amax = torch.zeros(grid(shape, block), device=flat.device)
    part = region.abs().reshape(-1, block, cols // block, block).amax(dim=(1, 3)).float()
    amax[first:first + part.shape[0]] = part
    return amax


def quantize_slice(flat: torch.Tensor, offset: int, shape: torch.Size, block: int | None,
                   scale: torch.Tensor) -> torch.Tensor:
    """The slice's E4M3 values, each element scaled by its block's entry of `scale` (a grid)."""
    if block is None:
        return quantize(flat, scale.reshape(()), E4M3)
    region, first = _block_rows(flat, offset, shape, block)
    rows, cols = shape
    count = region.shape[0] // block
    blocks = region.view(count, block, cols // block, block)
    values = quantize(blocks, scale[first:first + count].view(count, 1, cols // block, 1), E4M3).flatten()
    lead = offset - first * block * cols
    return values[lead:lead + flat.numel()]


def _block_rows(flat: torch.Tensor, offset: int, shape: torch.Size, block: int) -> tuple[torch.Tensor, int]:
    """The slice placed in the whole rows of blocks that it touches, zeros around it; and the
    index of the first of those block rows."""
    rows, cols = shape
    first = offset // cols // block
    end = _ceil_div(_ceil_div(offset + flat.numel(), cols), block)   # past the block row of the last element
    region = torch.zeros((end - first) * block * cols, dtype=flat.dtype, device=flat.device)
    lead = offset - first * block * cols
    region[lead:lead + flat.numel()] = flat
    return region.view(-1, cols), first


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


if triton is not None:
    @triton.jit
    def _block_amax_kernel(table, programs, amaxes, n_programs, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        row = table + 7 * tl.load(programs + pid)
        block_row, block_col = tl.load(programs + n_programs + pid), tl.load(programs + 2 * n_programs + pid)
        source = tl.load(row).to(tl.pointer_type(tl.bfloat16))
        n, offset, cols, first_scale = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4), tl.load(row + 6)
        rows = block_row * BLOCK + tl.arange(0, BLOCK)[:, None]
        columns = block_col * BLOCK + tl.arange(0, BLOCK)[None, :]
        at = rows * cols + columns - offset   # in the slice
        x = tl.load(source + at, mask=(at >= 0) & (at < n), other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.store(amaxes + first_scale + block_row * (cols // BLOCK) + block_col, amax)

    @triton.jit
    def _cast_kernel(table, programs, scales, n_programs, LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                     CHUNK: tl.constexpr):
        pid = tl.program_id(0)
        row = table + 7 * tl.load(programs + pid)
        chunk = tl.load(programs + n_programs + pid)
        source = tl.load(row).to(tl.pointer_type(tl.bfloat16))
        target = tl.load(row + 1).to(tl.pointer_type(tl.float8e4nv))
        n, offset, cols = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
        block, first_scale = tl.load(row + 5), tl.load(row + 6)
        for start in range(0, CHUNK, BLOCK):
            at = chunk * CHUNK + start + tl.arange(0, BLOCK)
            mask = at < n
            x = tl.load(source + at, mask=mask, other=0.0).to(tl.float32)
            if block > 0:   # the element's 128x128 block, row-major in the weight's grid
                element = offset + at
                index = (element // cols // block) * (cols // block) + (element % cols) // block
            else:
                index = tl.zeros_like(at)
            scale = tl.load(scales + first_scale + index, mask=mask, other=1.0)
            value = tl.minimum(tl.maximum(x * scale, -LIMIT), LIMIT)
            tl.store(target + at, value.to(tl.float8e4nv), mask=mask)

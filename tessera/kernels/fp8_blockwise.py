"""Blockwise FP8 linear layers (--fp8-recipe blockwise): DeepSeek-V3's and TE Float8BlockScaling's scaling.

Every GEMM operand is E4M3 with one fp32 scale per block of 128 along the GEMM's contraction
dimension: activations and output gradients in 1x128 tiles, weights in 128x128 blocks, so an
outlier costs precision only in its own block. Each of a linear layer's three GEMMs contracts
over another dimension, so each quantises its operands along that one:

    fprop  y  = x  W^T    x in tiles along K (features),      W in 128x128 blocks
    dgrad  dx = dy W      dy in tiles along N (out features),  W^T: the same blocks, transposed
    wgrad  dW = dy^T x    dy^T and x^T in tiles along M (tokens), each quantised from the
                          high-precision tensor (not from the rowwise copy), as TE does

Scales are powers of 2 (TE's default for this recipe): a dequantisation is then exact, and an
emulation on the CPU computes exactly the values cuBLAS multiplies. On CUDA the GEMMs are
cuBLAS's block-scaled ones through torch.nn.functional.scaled_mm (Hopper only, E4M3 operands
only; each 128-deep partial sum scaled and added in fp32); elsewhere `emulated_mm` dequantises
and multiplies in fp32, which is what the CPU tests check. Dimensions must be multiples of 128
(tessera.training.fp8 checks them per layer, with the flag's name, before training starts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.kernels.fp8 import E4M3, Fp8Gemm, Fp8Recipe, linear_by, quantize, scale_for

BLOCK = 128
_EXPONENT_BITS = 0x7F800000   # of an fp32: keeping only them rounds a positive normal number down to a power of 2


def power_of_2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The largest power of 2 that keeps amax x scale within E4M3's range."""
    scale = scale_for(amax, E4M3)
    return (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def quantize_tiles(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> its E4M3 copy and the dequantisation scales (rows, cols / 128): one per 1x128 tile."""
    rows, cols = x.shape
    tiles = x.reshape(rows, cols // BLOCK, BLOCK)
    scale = power_of_2_scale(tiles.abs().amax(dim=2, keepdim=True))
    return quantize(tiles, scale, E4M3).reshape(rows, cols), scale.reciprocal().reshape(rows, cols // BLOCK)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> its E4M3 copy and the dequantisation scales (rows / 128, cols / 128): one per 128x128 block."""
    rows, cols = w.shape
    blocks = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = power_of_2_scale(blocks.abs().amax(dim=(1, 3), keepdim=True))
    return (quantize(blocks, scale, E4M3).reshape(rows, cols),
            scale.reciprocal().reshape(rows // BLOCK, cols // BLOCK))


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The fp32 values an FP8 copy stands for; tiles or blocks, as the scales' shape says."""
    rows_per_scale = data.shape[0] // scale_inv.shape[0]
    return data.float() * scale_inv.repeat_interleave(rows_per_scale, 0).repeat_interleave(BLOCK, 1)


def emulated_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T of two blockwise FP8 operands (each quantised along K, its last dimension), in fp32."""
    return (dequantize(a, a_scale_inv) @ dequantize(b, b_scale_inv).t()).to(out_dtype)


def _outer_dim_major(scale_inv: torch.Tensor) -> torch.Tensor:
    """1x128 scales as cuBLAS reads them: shape (rows, K / 128), the rows contiguous."""
    return scale_inv.t().contiguous().t()


@torch.library.custom_op("tessera::fp8_blockwise_mm", mutates_args=())
def cublas_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """emulated_mm's product by cuBLAS: a in 1x128 tiles, b in 1x128 tiles or 128x128 blocks.

    An opaque op, so that torch.compile passes the scales in exactly the layouts made here.
    """
    if b_scale_inv.shape[0] == b.shape[0]:
        b_scale, b_recipe = _outer_dim_major(b_scale_inv), F.ScalingType.BlockWise1x128
    else:   # 128x128: (K / 128 padded to a multiple of 4, N / 128), K contiguous (16-byte aligned columns)
        b_scale = F.pad(b_scale_inv, (0, -b_scale_inv.shape[1] % 4)).contiguous().t()
        b_recipe = F.ScalingType.BlockWise128x128
    return F.scaled_mm(a.contiguous(), b.contiguous().t(), _outer_dim_major(a_scale_inv), F.ScalingType.BlockWise1x128,
                       b_scale, b_recipe, output_dtype=out_dtype)


@cublas_mm.register_fake
def _(a, a_scale_inv, b, b_scale_inv, out_dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def blockwise_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T: cuBLAS on CUDA, the fp32 emulation elsewhere."""
    gemm = cublas_mm if a.is_cuda else emulated_mm
    return gemm(a, a_scale_inv, b, b_scale_inv, out_dtype)


class BlockwiseFp8Linear(Fp8Gemm):
    """The blockwise FP8 GEMM of one linear layer: `fp8(x, weight, bias)` in place of F.linear. No state:
    every scale comes from the tensor being cast, now (with --fp8-param-gather the weight's from the
    whole weight's blocks as the optimizer gathered it: `weight_fp8_scale` holds their inverses)."""

    weight_block = BLOCK

    def __init__(self, recipe: Fp8Recipe):
        super().__init__()
        self.recipe = recipe

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_by(_BlockwiseMatmul, self, x, weight, bias)

    @staticmethod
    def weight_scales(layers: list["BlockwiseFp8Linear"], amaxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block's scale from its amax: as cast with, and stored as the GEMMs take them (inverted)."""
        scales = power_of_2_scale(amaxes)
        return scales, scales.reciprocal()

    def quantized_weight(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight's E4M3 blocks and their inverse scales: gathered, or cast now."""
        gathered = self.gathered(weight)
        return gathered if gathered is not None else quantize_blocks(weight)


class _BlockwiseMatmul(torch.autograd.Function):
    """The three blockwise GEMMs. As the tensorwise recipe's, the backward saves the high-precision
    input and weight (held anyway, or recomputed under torch.compile) and casts again: the weight's
    blocks give the forward's bits (dgrad takes them transposed: a block of W^T holds the same
    values), and the tokens-wise tiles of wgrad need the high-precision input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layer: BlockwiseFp8Linear, out_dtype: torch.dtype):
        ctx.save_for_backward(x, weight)
        ctx.fp8_wgrad, ctx.out_dtype = layer.recipe.fp8_wgrad, out_dtype
        ctx.layer = layer
        return blockwise_mm(*quantize_tiles(x), *layer.quantized_weight(weight), out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        w8, w_scale_inv = ctx.layer.quantized_weight(weight)
        grad_x = blockwise_mm(*quantize_tiles(grad), w8.t(), w_scale_inv.t(), ctx.out_dtype)
        if ctx.fp8_wgrad:   # straight into the weight's dtype, as the tensorwise recipe's
            grad_w = blockwise_mm(*quantize_tiles(grad.t()), *quantize_tiles(x.t()), weight.dtype)
        else:
            grad_w = (grad.to(ctx.out_dtype).t() @ x.to(ctx.out_dtype)).to(weight.dtype)
        return grad_x, grad_w, None, None

"""The decode step of a single request through fused kernels: six launches a layer.

At batch 1 a decode step reads every weight once and does almost nothing else, so its time
is the weights' bytes over the bandwidth plus a gap per kernel. Through the model's own
modules (compiled by inductor) a LLaMA-style layer is ~11 kernels: the norms, the RoPE and
cache writes and SwiGLU between the GEMVs. Here each layer is

    norm_gemv     residual += previous branch, RMSNorm, QKV projection
    rotate_cache_and_attend   RoPE on q and k, k and v into the cache, attention (two
                  kernels: the context's splits, their merge)
    gemv          output projection
    norm_gemv     residual += attention, RMSNorm, fc1 ([gate | up])
    swiglu_gemv   SiLU(gate) * up, fc2

and the final norm is folded into the output layer's GEMV the same way (tessera.kernels.gemv
and paged_decode). The weights are the model's, read in place; the engine uses this path for
decode steps of one row on CUDA when `supported(model)` (the modules it replaces are the
plain ones: RMSNorm, rotate-half RoPE, GQA attention without biases or query/key norms,
SwiGLU without biases, no tensor parallelism, no MoE or MLA), and the model's forward
everywhere else. tests/gpu/test_decode_kernels_cuda.py holds it to the model's logits.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.inference.paged_attention import StepAttention
from tessera.kernels import gemv, paged_decode
from tessera.models.attention import Attention
from tessera.models.gpt import GPTModel
from tessera.models.mlp import MLP
from tessera.parallel.sharding import rank_and_size


def supported(model: GPTModel) -> bool:
    """Whether this step can run the model: on CUDA with Triton, and `computes_the_same_layers`."""
    return gemv.triton is not None and next(model.parameters()).is_cuda and computes_the_same_layers(model)


def computes_the_same_layers(model: GPTModel) -> bool:
    """Whether every module on the decode path is one this step computes exactly."""
    if model.rotary is None or rank_and_size(model.tp_group)[1] > 1 or model.final_norm is None \
            or model.embedding is None:
        return False
    rotary_dim = model.rotary.cos.shape[-1]
    for _, block in model.layers.items():
        attention, mlp = block.attention, block.mlp
        if not (type(attention) is Attention and type(mlp) is MLP and mlp.swiglu
                and attention.q_norm is None and attention.sinks is None and attention.window is None
                and not attention.gate_width
                and attention.qkv.bias is None and attention.proj.bias is None
                and mlp.fc1.bias is None and mlp.fc2.bias is None and rotary_dim <= attention.head_dim
                and not _adapted(attention.qkv, attention.proj, mlp.fc1, mlp.fc2)
                and all(_is_rms_norm(n) for n in (block.input_norm, block.post_attention_norm))):
            return False
    return _is_rms_norm(model.final_norm)


def _adapted(*linears: nn.Module) -> bool:
    """Whether a LoRA adapter rides on any of the layers (unmerged, as GRPO's rollouts run them):
    the fused kernels read the base weights alone."""
    return any(getattr(linear, "adapter", None) is not None for linear in linears)


def _is_rms_norm(norm: nn.Module) -> bool:
    return isinstance(norm, nn.RMSNorm) and norm.weight is not None


def _eps(norm: nn.RMSNorm, dtype: torch.dtype) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps


def decode_logits(model: GPTModel, input_ids: torch.Tensor, positions: torch.Tensor,
                  step: StepAttention) -> torch.Tensor:
    """Logits [1, padded vocab] of one token id [1] at position [1] (the step's cache and tables)."""
    residual = model.embed(input_ids[None], positions[None]).view(-1)
    dtype = residual.dtype
    delta = torch.zeros_like(residual)
    for index, block in model.layers.items():
        attention, mlp = block.attention, block.mlp
        keys, values = step.pools[index]
        residual, qkv = gemv.norm_gemv(residual, delta, block.input_norm.weight, _eps(block.input_norm, dtype),
                                       attention.qkv.weight)
        out = paged_decode.rotate_cache_and_attend(qkv[None], model.rotary.cos, model.rotary.sin, keys, values,
                                                   step.decode_tables, positions, step.block_size,
                                                   attention.num_heads, attention.head_dim ** -0.5)
        delta = gemv.gemv(out.view(-1), attention.proj.weight)
        residual, gate_up = gemv.norm_gemv(residual, delta, block.post_attention_norm.weight,
                                           _eps(block.post_attention_norm, dtype), mlp.fc1.weight)
        delta = gemv.swiglu_gemv(gate_up, mlp.fc2.weight)
    output_weight = model.embedding.weight if model.output_weight is None else model.output_weight
    _, logits = gemv.norm_gemv(residual, delta, model.final_norm.weight, _eps(model.final_norm, dtype), output_weight)
    return logits[None]

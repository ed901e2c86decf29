"""Activations a Mamba-2 (`M`) or Gated DeltaNet (`G`) layer of a hybrid stack saves for backward.

Counted as tessera.perf.memory counts a transformer layer's: tensor by tensor, from what autograd
keeps of tessera.models.mamba and tessera.models.gated_deltanet (saved-tensor hooks,
tests/perf/test_hybrid_memory.py). Per layer and micro-batch, with T = s x b tokens (s per CP
rank), h hidden, and per TP rank (TP splits the heads and groups) n heads of P channels (d = nP),
g groups of state N (G = gN), K conv taps; for Gated DeltaNet qk = key heads x key dim, v = n x V
with n value heads:

  sharded only by sequence parallelism   the norm's input (fp32 or bf16, as the residual stream)
  GEMM input (gathered under SP)         in_proj's input 2Th
  sharded by TP, outside the scan        in_proj's whole output (the conv input is a view of
                                          it), the conv's output (K - 1 tokens longer), the
                                          gated norm's fp32 inputs, out_proj's input
  sharded by TP, the chunked scan        per padded token (T' = b x s rounded up to chunks of l:
                                          128 for SSD, 64 for the delta rule), the fp32 products of
                                          the chunked algorithm (tessera.kernels.ssd and
                                          delta_rule run without autocast): the intra-chunk
                                          l x l decays and scores per head, B and C (or q and k)
                                          repeated per head, x (or v); per chunk the states
                                          entering it, n x P x N (or n x K x V) each

A compiled layer fuses the elementwise chains (the masked exponentials, the gated norm) and keeps
about half of what eager autograd does; which tensors inductor keeps was read off the measured
lists at 2, 4, 5, 8, 9 and 16 chunks. A layer under --recompute-granularity full keeps its input
only (tessera.perf.memory); selective recompute is attention's and changes nothing here. FP8
projections in these layers (--fp8-format) are not modelled: they are priced as bf16.

Megatron-Core runs these mixers through fused Triton kernels (mamba_ssm's
mamba_split_conv1d_scan_combined, flash-linear-attention's chunk_gated_delta_rule) that keep
their inputs and outputs and recompute the chunks in backward: for framework "megatron" only the
tensors outside the scan are counted (an estimate, not measured here).
"""

from __future__ import annotations

import math

from tessera.config import ModelConfig
from tessera.config.hybrid import GATED_DELTANET, MAMBA
from tessera.kernels.delta_rule import CHUNK_SIZE as DELTA_RULE_CHUNK
from tessera.kernels.ssd import CHUNK_SIZE as SSD_CHUNK
from tessera.perf.layout import Layout

MIXERS = (MAMBA, GATED_DELTANET)


def mixer_activation_bytes(model: ModelConfig, layout: Layout, seq_length: int, symbol: str,
                           residual: int) -> float:
    """What one `M` or `G` layer saves for backward, for one micro-batch on one GPU (`residual` the
    bytes of an element of the residual stream)."""
    s, b, h = seq_length / layout.cp, layout.micro_batch_size, model.hidden_size
    sp = layout.tp if layout.sequence_parallel else 1
    if layout.recompute == "full":
        return residual * s * b * h / sp
    tokens = s * b
    replicated = residual * tokens * h + (tokens * h if model.hidden_dropout > 0 else 0.0)   # norm input, mask
    gathered = 2 * tokens * h   # in_proj's input
    terms = _mamba_terms if symbol == MAMBA else _gated_deltanet_terms
    outside, scan = terms(model, layout, s, b)
    sharded = outside + scan
    if layout.framework == "tessera" and not layout.tp_comm_overlap:   # in_proj keeps its gathered input
        return replicated / sp + gathered + sharded
    return (replicated + gathered) / sp + sharded


def _chunks(s: float, length: int) -> tuple[int, float]:
    """(chunks, padded tokens per sequence) of the chunked scan over `s` tokens."""
    chunks = math.ceil(s / length)
    return chunks, chunks * length


def _mamba_terms(model: ModelConfig, layout: Layout, s: float, b: int) -> tuple[float, float]:
    """(bytes outside the SSD scan, bytes of the scan) of a Mamba-2 layer, this TP rank's heads."""
    from tessera.models.mamba import CONV_KERNEL

    t, tessera_eager = layout.tp, not layout.compiled
    heads, P, N = model.mamba_num_heads / t, model.mamba_head_dim, model.mamba_state_dim
    d, states = heads * P, model.mamba_num_groups * N / t
    tokens = s * b
    projected = 2 * tokens * (2 * d + 2 * states + heads)
    if layout.framework != "tessera":   # the fused kernel's two outputs (before and after the gate), out_proj's input
        return projected + 6 * tokens * d, 0.0
    conv = 2 * b * (s + CONV_KERNEL - 1) * (d + 2 * states)
    # x in fp32 (D x's input), out_proj's input; the gated norm's fp32 chain (eager) or its fp32
    # product and y in bf16 (compiled); eager also keeps dt after softplus.
    outside = projected + conv + 4 * tokens * d + 2 * tokens * d
    outside += 20 * tokens * d + 4 * tokens * heads if tessera_eager else 6 * tokens * d
    chunks, padded = _chunks(s, SSD_CHUNK)
    rows, length, state = b * padded, SSD_CHUNK, b * heads * P * N   # padded tokens, chunk, one state
    if tessera_eager:
        # decays, scores and their product (l x l per head), B and C per head, x and dt x, per-head
        # cumulative decays, the document mask; the entering states stacked, and each but the last
        # again where the next one is computed from it
        scan = (12 * rows * heads * length + 20 * rows * heads * N + 16 * rows * d + 20 * rows * heads
                + rows * length + (8 * chunks - 4) * state)
    else:
        # the l x l weights, B and C per head (fp32 once, bf16 twice), x chunked twice, the cumulative
        # decays; the states between chunks in fp32 and all entering states stacked in bf16
        scan = (4 * rows * heads * length + 8 * rows * heads * N + 8 * rows * d + 8 * rows * heads
                + 4 * max(chunks - 2, 0) * state + 2 * chunks * state)
    return outside, scan


def _gated_deltanet_terms(model: ModelConfig, layout: Layout, s: float, b: int) -> tuple[float, float]:
    """(bytes outside the delta rule, bytes of the rule) of a Gated DeltaNet layer, this TP rank's heads."""
    t, tessera_eager = layout.tp, not layout.compiled
    heads, K, V = model.linear_num_value_heads / t, model.linear_key_head_dim, model.linear_value_head_dim
    qk, v = model.linear_num_key_heads / t * K, heads * V
    tokens, kernel = s * b, model.linear_conv_kernel_dim
    projected = 2 * tokens * (2 * qk + 2 * v + 2 * heads)
    if layout.framework != "tessera":   # the fused kernel's output, the gated norm's, out_proj's input
        return projected + 6 * tokens * v, 0.0
    conv = 2 * b * (s + kernel - 1) * (2 * qk + v)
    outside = projected + conv + 2 * tokens * v   # + out_proj's input
    # the gated norm's fp32 chain, q and k before their L2 norm, per-head gates and norm statistics
    outside += (20 * tokens * v + 8 * tokens * qk + 16 * tokens * heads if tessera_eager
                else 6 * tokens * v + 4 * tokens * qk + 8 * tokens * heads)
    chunks, padded = _chunks(s, DELTA_RULE_CHUNK)
    rows, length, state = b * padded, DELTA_RULE_CHUNK, b * heads * K * V
    per_chunk_keys = b * heads * K * length   # one chunk's keys (or queries) of every head
    if tessera_eager:
        # l x l decays, masks and scores; q and k per value head and their products; the solved
        # [U | W]; v; per-head decays; the document mask; every chunk's state
        scan = (24 * rows * heads * length + 4 * rows * heads * (K + V) + 8 * (chunks - 1) * per_chunk_keys
                + 24 * rows * heads * K + 8 * rows * v + 24 * rows * heads + rows * length + 4 * chunks * state)
    else:
        scan = (14 * rows * heads * length + 8 * rows * heads * K + 2 * (2 * chunks - 2) * per_chunk_keys
                + 2 * rows * heads * (K + V) + 6 * rows * v + 8 * rows * heads
                + 4 * max(chunks - 2, 0) * state + 2 * state)
    return outside, scan

"""Decode attention straight from the paged KV cache: one new token per request, two Triton kernels.

    out = paged_decode_attention(q, key_pool, value_pool, tables, positions, block_size, scale)
    out = rotate_cache_and_attend(qkv, cos_table, sin_table, key_pool, value_pool, tables, positions,
                                  block_size, heads, scale)   # from the QKV projection's output

q [rows, heads, d], the query of row r's new token at position `positions[r]`, attends to
positions 0..positions[r] of the row's context, whose position p lives in pool slot
`tables[r, p // block_size] * block_size + p % block_size` (tessera.inference.kv_cache).
Written by hand because neither SDPA nor the FlashAttention kernel that torch ships reads a
block table: without one, every layer first copies its context out of the pool (measured on
an H200, config B: 20 us a layer at batch 32, of which 7 us gathering; the rest in cuDNN
over padded, masked keys).

Flash-decoding: the context is cut into splits of `SPLIT` positions, one program per (row,
KV head, split) so that even one short request fills the GPU; each program reads its keys
and values once for all the query heads of its group (GQA without repeating the cache),
keeps an online softmax in fp32, and writes its unnormalised output with the running max
and sum; a second kernel merges the splits of each (row, head). The number of splits
depends only on the block table's width, so a CUDA graph captured for one table width
replays for any lengths up to it.

`rotate_cache_and_attend` starts from the fused QKV projection's output instead (the fused
decode step of tessera.inference.fused_decode): every program rotates its group's query
heads (RoPE, rotate-half, over the first `cos_table.shape[1]` channels) and the new key, the
program whose split holds the new position writes the key and value into their pool slot,
and all use the new key and value from registers: the rotation and the cache write cost no
kernel of their own (a separate one was ~1.2 us a layer, its gaps besides). Both take the new
tokens' positions (and the whole RoPE tables) rather than context lengths, slots or cos/sin
rows computed from them: under torch.compile such small index computations are recomputed
before every layer's kernel (~60 us a step at batch 1, measured on an H200). The kernels
launch with programmatic dependent launch on Hopper (tessera.kernels.gemv).
"""

from __future__ import annotations

import math

import torch

from tessera.kernels.gemv import pdl

try:
    import triton
    import triton.language as tl

    from tessera.kernels.gemv import wait_for_previous_kernel
except ImportError:   # CPU-only torch ships without Triton
    triton = None

CHUNK = 32          # positions per inner step (keys loaded together)
TARGET_PROGRAMS = 512   # enough (row, group, split) programs to fill an H200's 132 SMs a few times


def available(q: torch.Tensor) -> bool:
    return triton is not None and q.is_cuda


def split_length(rows: int, groups: int, positions: int) -> int:
    """Positions per split: at least CHUNK, and splits enough for ~TARGET_PROGRAMS programs."""
    wanted = max(1, TARGET_PROGRAMS // (rows * groups))
    chunks = math.ceil(positions / CHUNK)
    return CHUNK * max(1, math.ceil(chunks / wanted))


if triton is not None:

    @triton.jit
    def _rotated(base, d, cos, sin, mask, ROTARY: tl.constexpr):
        """RoPE (rotate-half) over the first ROTARY channels of the vectors at base + d, in their dtype."""
        half = ROTARY // 2
        x = tl.load(base + d, mask=mask, other=0.0)
        partner = tl.load(base + tl.where(d < half, d + half, d - half), mask=mask & (d < ROTARY), other=0.0)
        rotated = x * cos.to(x.dtype) + tl.where(d < half, -partner, partner) * sin.to(x.dtype)   # as apply_rotary
        return tl.where(d < ROTARY, rotated, x)

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, partial_ptr, stats_ptr, cos_ptr, sin_ptr,
                      q_row_stride, q_head_stride, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                      table_stride, rope_stride, scale,
                      HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      DIM: tl.constexpr, DIM_PAD: tl.constexpr, DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                      CHUNK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, ROTARY: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(positions_ptr + row) + 1
        member = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + member
        d, dv = tl.arange(0, DIM_PAD), tl.arange(0, DIM_V_PAD)
        q_mask = (member[:, None] < GROUP) & (d[None, :] < DIM)
        if ROTARY:   # q_ptr is the QKV projection's output: rotate q and the new key, cache the key and value
            cos = tl.load(cos_ptr + (length - 1) * rope_stride + d, mask=d < ROTARY, other=1.0)
            sin = tl.load(sin_ptr + (length - 1) * rope_stride + d, mask=d < ROTARY, other=0.0)
            q = _rotated(q_ptr + row * q_row_stride + heads[:, None] * DIM, d[None, :], cos[None, :], sin[None, :],
                         q_mask, ROTARY)
            new_key = _rotated(q_ptr + row * q_row_stride + (HEADS + kv_head) * DIM, d, cos, sin, d < DIM, ROTARY)
            new_value = tl.load(q_ptr + row * q_row_stride + (HEADS + HEADS // GROUP + kv_head) * DIM + dv,
                                mask=dv < DIM_V, other=0.0)
            last = length - 1
            if split == last // SPLIT:   # the one program whose positions hold the new token
                slot = tl.load(tables_ptr + row * table_stride + last // BLOCK_SIZE) * BLOCK_SIZE + last % BLOCK_SIZE
                tl.store(k_ptr + slot * k_slot_stride + kv_head * k_head_stride + d, new_key, mask=d < DIM)
                tl.store(v_ptr + slot * v_slot_stride + kv_head * v_head_stride + dv, new_value, mask=dv < DIM_V)
        else:
            q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + d[None, :], mask=q_mask,
                        other=0.0)
        running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_V_PAD], tl.float32)
        for offset in range(0, SPLIT, CHUNK):   # a split past the row's length loads nothing
            position = split * SPLIT + offset + tl.arange(0, CHUNK)
            valid = position < length
            block = tl.load(tables_ptr + row * table_stride + position // BLOCK_SIZE, mask=valid, other=0)
            slot = block * BLOCK_SIZE + position % BLOCK_SIZE
            keys = tl.load(k_ptr + slot[:, None] * k_slot_stride + kv_head * k_head_stride + d[None, :],
                           mask=valid[:, None] & (d[None, :] < DIM), other=0.0)
            if ROTARY:   # the new token's key is not read back from the cache this kernel writes
                keys = tl.where((position == length - 1)[:, None], new_key[None, :], keys)
            scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale     # [GROUP_PAD, CHUNK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)   # nothing valid yet: no NaN from -inf - -inf
            correction = tl.exp(running_max - shift)
            probs = tl.exp(scores - shift[:, None])
            running_sum = running_sum * correction + tl.sum(probs, 1)
            values = tl.load(v_ptr + slot[:, None] * v_slot_stride + kv_head * v_head_stride + dv[None, :],
                             mask=valid[:, None] & (dv[None, :] < DIM_V), other=0.0)
            if ROTARY:
                values = tl.where((position == length - 1)[:, None], new_value[None, :], values)
            acc = acc * correction[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=PRECISION)
            running_max = new_max
        # partial [rows, heads, splits, DIM_V], stats [rows, heads, splits, 2] = (max, sum)
        at = (row * HEADS + heads) * SPLITS + split
        tl.store(partial_ptr + at[:, None] * DIM_V + dv[None, :], acc,
                 mask=(member[:, None] < GROUP) & (dv[None, :] < DIM_V))
        tl.store(stats_ptr + at * 2, running_max, mask=member < GROUP)
        tl.store(stats_ptr + at * 2 + 1, running_sum, mask=member < GROUP)

    @triton.jit
    def _merge_kernel(partial_ptr, stats_ptr, out_ptr, out_row_stride, out_head_stride,
                      HEADS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                      DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row, head = tl.program_id(0), tl.program_id(1)
        split, dv = tl.arange(0, SPLITS_PAD), tl.arange(0, DIM_V_PAD)
        at = (row * HEADS + head) * SPLITS + split
        # splits past a row's length hold max -inf and sum 0: their weight below is 0
        maxes = tl.load(stats_ptr + at * 2, mask=split < SPLITS, other=float("-inf"))
        sums = tl.load(stats_ptr + at * 2 + 1, mask=split < SPLITS, other=0.0)
        weights = tl.exp(maxes - tl.max(maxes, 0))
        partial = tl.load(partial_ptr + at[:, None] * DIM_V + dv[None, :],
                          mask=(split[:, None] < SPLITS) & (dv[None, :] < DIM_V), other=0.0)
        out = tl.sum(partial * weights[:, None], 0) / tl.sum(sums * weights, 0)
        tl.store(out_ptr + row * out_row_stride + head * out_head_stride + dv, out.to(out_ptr.dtype.element_ty),
                 mask=dv < DIM_V)

    def _pad(n: int, low: int = 16) -> int:
        return max(low, triton.next_power_of_2(n))

    def _attend(q, key_pool, value_pool, tables, positions, block_size: int, scale: float, heads: int,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The split and merge kernels; q is [rows, heads, d], or with `rope` (the cos and sin
        tables) the QKV projection's output [rows, (heads + 2 groups) d] of the new tokens."""
        rows = q.shape[0]
        groups, dim, dim_v = key_pool.shape[1], key_pool.shape[2], value_pool.shape[2]
        context = tables.shape[1] * block_size
        split = split_length(rows, groups, context)
        splits = math.ceil(context / split)
        partial = torch.empty(rows, heads, splits, dim_v, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
        out = torch.empty(rows, heads, dim_v, dtype=q.dtype, device=q.device)
        tables = tables.contiguous()
        cos, sin = rope if rope is not None else (stats, stats)   # unread without rope
        _split_kernel[(rows, groups, splits)](
            q, key_pool, value_pool, tables, positions, partial, stats, cos, sin,
            q.stride(0), q.stride(1) if rope is None else dim, key_pool.stride(0), key_pool.stride(1),
            value_pool.stride(0), value_pool.stride(1), tables.stride(0), cos.stride(0), scale,
            HEADS=heads, GROUP=heads // groups, GROUP_PAD=_pad(heads // groups), DIM=dim, DIM_PAD=_pad(dim),
            DIM_V=dim_v, DIM_V_PAD=_pad(dim_v), BLOCK_SIZE=block_size, SPLIT=split, SPLITS=splits,
            CHUNK=CHUNK, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl(q),
            ROTARY=0 if rope is None else cos.shape[1], num_warps=4, launch_pdl=pdl(q))
        _merge_kernel[(rows, heads)](partial, stats, out, out.stride(0), out.stride(1), HEADS=heads, SPLITS=splits,
                                     SPLITS_PAD=_pad(splits, 2), DIM_V=dim_v, DIM_V_PAD=_pad(dim_v), PDL=pdl(q),
                                     num_warps=4, launch_pdl=pdl(q))
        return out

    @torch.library.custom_op("tessera::paged_decode_attention", mutates_args=())
    def paged_decode_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                               tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                               scale: float) -> torch.Tensor:
        """q [rows, heads, d]; pools [slots, kv heads, d | d_v]; tables [rows, blocks] and positions
        [rows] int64 -> [rows, heads, d_v] in q's dtype."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        return _attend(q, key_pool, value_pool, tables, positions, block_size, scale, q.shape[1])

    @paged_decode_attention.register_fake
    def _(q, key_pool, value_pool, tables, positions, block_size, scale):
        return q.new_empty(q.shape[0], q.shape[1], value_pool.shape[2])

    @torch.library.custom_op("tessera::rotate_cache_and_attend", mutates_args=("key_pool", "value_pool"))
    def rotate_cache_and_attend(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                                key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
                                positions: torch.Tensor, block_size: int, heads: int, scale: float) -> torch.Tensor:
        """qkv [rows, (heads + 2 groups) d], the QKV projection's output of each row's new token at
        `positions`; the RoPE tables [positions, rotary dim] -> attention [rows, heads, d], the new
        keys (rotated) and values written into the pools."""
        return _attend(qkv.contiguous(), key_pool, value_pool, tables, positions, block_size, scale, heads,
                       (cos_table, sin_table))

    @rotate_cache_and_attend.register_fake
    def _(qkv, cos_table, sin_table, key_pool, value_pool, tables, positions, block_size, heads, scale):
        return qkv.new_empty(qkv.shape[0], heads, value_pool.shape[2])

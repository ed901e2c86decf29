"""Decode attention straight from the paged KV cache: one new token per request, two Triton kernels.

    out = paged_decode_attention(q, key_pool, value_pool, tables, positions, block_size, scale)
    q = rotate_and_cache(qkv, cos_table, sin_table, key_pool, value_pool, table, position, block_size,
                         heads, groups, head_dim)   # one request

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

`rotate_and_cache` is what comes before it for a single request (the fused decode step of
tessera.inference.fused_decode): the fused QKV projection's output of one token, its query
and key heads rotated (RoPE, rotate-half, over the first `cos_table.shape[1]` channels), the
query returned and the key and value written into their pool slot, in one kernel instead of
the rotation and the two scatters. Both take the new tokens' positions (and the whole RoPE
tables) rather than context lengths, slots or cos/sin rows computed from them: under
torch.compile such small index computations are recomputed before every layer's kernel
(~60 us a step at batch 1, measured on an H200). All three kernels launch with programmatic
dependent launch on Hopper (tessera.kernels.gemv).
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
    def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, positions_ptr, partial_ptr, stats_ptr,
                      q_row_stride, q_head_stride, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                      table_stride, scale,
                      HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                      DIM: tl.constexpr, DIM_PAD: tl.constexpr, DIM_V: tl.constexpr, DIM_V_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, SPLITS: tl.constexpr,
                      CHUNK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(positions_ptr + row) + 1
        member = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + member
        d, dv = tl.arange(0, DIM_PAD), tl.arange(0, DIM_V_PAD)
        q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + d[None, :],
                    mask=(member[:, None] < GROUP) & (d[None, :] < DIM), other=0.0)
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
            scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale     # [GROUP_PAD, CHUNK]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)   # nothing valid yet: no NaN from -inf - -inf
            correction = tl.exp(running_max - shift)
            probs = tl.exp(scores - shift[:, None])
            running_sum = running_sum * correction + tl.sum(probs, 1)
            values = tl.load(v_ptr + slot[:, None] * v_slot_stride + kv_head * v_head_stride + dv[None, :],
                             mask=valid[:, None] & (dv[None, :] < DIM_V), other=0.0)
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

    @torch.library.custom_op("tessera::paged_decode_attention", mutates_args=())
    def paged_decode_attention(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                               tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                               scale: float) -> torch.Tensor:
        """q [rows, heads, d]; pools [slots, kv heads, d | d_v]; tables [rows, blocks] and positions
        [rows] int64 -> [rows, heads, d_v] in q's dtype."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        rows, heads, dim = q.shape
        groups, dim_v = key_pool.shape[1], value_pool.shape[2]
        context = tables.shape[1] * block_size
        split = split_length(rows, groups, context)
        splits = math.ceil(context / split)
        partial = torch.empty(rows, heads, splits, dim_v, dtype=torch.float32, device=q.device)
        stats = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
        out = torch.empty(rows, heads, dim_v, dtype=q.dtype, device=q.device)
        tables = tables.contiguous()
        precision = "ieee" if q.dtype == torch.float32 else "tf32"
        _split_kernel[(rows, groups, splits)](
            q, key_pool, value_pool, tables, positions, partial, stats,
            q.stride(0), q.stride(1), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0),
            value_pool.stride(1), tables.stride(0), scale,
            HEADS=heads, GROUP=heads // groups, GROUP_PAD=_pad(heads // groups), DIM=dim, DIM_PAD=_pad(dim),
            DIM_V=dim_v, DIM_V_PAD=_pad(dim_v), BLOCK_SIZE=block_size, SPLIT=split, SPLITS=splits,
            CHUNK=CHUNK, PRECISION=precision, PDL=pdl(q), num_warps=4, launch_pdl=pdl(q))
        _merge_kernel[(rows, heads)](partial, stats, out, out.stride(0), out.stride(1), HEADS=heads, SPLITS=splits,
                                     SPLITS_PAD=_pad(splits, 2), DIM_V=dim_v, DIM_V_PAD=_pad(dim_v), PDL=pdl(q),
                                     num_warps=4, launch_pdl=pdl(q))
        return out

    @paged_decode_attention.register_fake
    def _(q, key_pool, value_pool, tables, positions, block_size, scale):
        return q.new_empty(q.shape[0], q.shape[1], value_pool.shape[2])

    @triton.jit
    def _rotate_and_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, tables_ptr, position_ptr, q_ptr, k_ptr, v_ptr,
                                 rope_stride, k_slot_stride, k_head_stride, v_slot_stride, v_head_stride,
                                 HEADS: tl.constexpr, GROUPS: tl.constexpr, DIM: tl.constexpr,
                                 DIM_PAD: tl.constexpr, ROTARY: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                 PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        head = tl.program_id(0)   # query heads, then key heads, then value heads: qkv's layout
        position = tl.load(position_ptr)
        d = tl.arange(0, DIM_PAD)
        x = tl.load(qkv_ptr + head * DIM + d, mask=d < DIM, other=0.0)
        half = ROTARY // 2
        rotates = (d < ROTARY) & (head < HEADS + GROUPS)
        partner = tl.load(qkv_ptr + head * DIM + tl.where(d < half, d + half, d - half), mask=rotates, other=0.0)
        cos = tl.load(cos_ptr + position * rope_stride + d, mask=rotates, other=1.0).to(x.dtype)
        sin = tl.load(sin_ptr + position * rope_stride + d, mask=rotates, other=0.0).to(x.dtype)
        rotated = x * cos + tl.where(d < half, -partner, partner) * sin   # in x's dtype, as apply_rotary
        x = tl.where(rotates, rotated, x)
        slot = tl.load(tables_ptr + position // BLOCK_SIZE) * BLOCK_SIZE + position % BLOCK_SIZE
        tl.store(q_ptr + head * DIM + d, x, mask=(d < DIM) & (head < HEADS))
        group = head - HEADS
        tl.store(k_ptr + slot * k_slot_stride + group * k_head_stride + d, x,
                 mask=(d < DIM) & (head >= HEADS) & (head < HEADS + GROUPS))
        group = head - HEADS - GROUPS
        tl.store(v_ptr + slot * v_slot_stride + group * v_head_stride + d, x,
                 mask=(d < DIM) & (head >= HEADS + GROUPS))

    @torch.library.custom_op("tessera::rotate_and_cache", mutates_args=("key_pool", "value_pool"))
    def rotate_and_cache(qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                         key_pool: torch.Tensor, value_pool: torch.Tensor, tables: torch.Tensor,
                         position: torch.Tensor, block_size: int, heads: int, groups: int,
                         head_dim: int) -> torch.Tensor:
        """qkv [(heads + 2 groups) * head_dim] of one token at position [1], the RoPE tables
        [positions, rotary dim], its block table [1, blocks] -> its rotated query [1, heads, head_dim];
        its key and value written at the position's slot."""
        q = torch.empty(1, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        _rotate_and_cache_kernel[(heads + 2 * groups,)](
            qkv, cos_table, sin_table, tables.contiguous(), position, q, key_pool, value_pool, cos_table.stride(0),
            key_pool.stride(0), key_pool.stride(1), value_pool.stride(0), value_pool.stride(1), HEADS=heads,
            GROUPS=groups, DIM=head_dim, DIM_PAD=_pad(head_dim), ROTARY=cos_table.shape[1], BLOCK_SIZE=block_size,
            PDL=pdl(qkv), num_warps=1, launch_pdl=pdl(qkv))
        return q

    @rotate_and_cache.register_fake
    def _(qkv, cos_table, sin_table, key_pool, value_pool, tables, position, block_size, heads, groups, head_dim):
        return qkv.new_empty(1, heads, head_dim)

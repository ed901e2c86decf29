"""RoPE on the QKV projection's output in one pass each way.

    q, k, v = rotary_qkv(qkv, cos, sin, heads, groups)   # qkv [b, s, (heads + 2 groups) d]

gives the rotated queries [b, s, heads, d], the rotated keys [b, s, groups, d] and the values
[b, s, groups, d], each a tensor of its own (attention keeps them; views of qkv would keep all
of it alive). cos and sin are the RotaryEmbedding tables, [s, 1, d] or [b, s, 1, d], rotating
all d channels in the rotate-half pairing (channel i with i + d/2).

Compiled, the backward was one Inductor kernel that rotated d q and d k back and laid them and
d v side by side as the QKV gradient, at ~1.6 TB/s (3.0 ms of config B's 226 ms of kernels on an
H200): a pointwise kernel over the concatenation, each element choosing its source among six
slices. Here a program takes 32 tokens and each of their heads in turn as its two halves: q, k
and v read and written once each way, one launch per q, k and v (3.05 ms a step for the forward
and the backward together, ~3.2 TB/s; B 1.006x faster). Both directions compute in fp32 from
tables rounded to the activations' dtype, as `apply_rotary` (the models' rotation in torch ops) does,
and round once. Without CUDA and Triton `apply_rotary` runs instead.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

ROWS = 32   # tokens a program rotates, every head of them


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [b, s, heads, d]; the rest pass through.

    The rotation pairs channel i with channel i + d/2 (rotate-half: LLaMA, Megatron). With
    `interleaved` the pairs are neighbours (x0, x1), (x2, x3), ... (DeepSeek's weights; HF
    rope_interleave, Megatron's MLA): gathering the even channels, then the odd ones, gives
    the rotate-half layout. The output stays in that order; queries and keys share it, so
    their dot products are those of the interleaved rotation.
    """
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        rotated = torch.cat([rotated[..., 0::2], rotated[..., 1::2]], dim=-1)
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * cos.to(x.dtype) + torch.cat([-second, first], dim=-1) * sin.to(x.dtype)
    return torch.cat([rotated, passed], dim=-1) if passed.shape[-1] else rotated


def rotary_qkv_applies(qkv: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotary_qkv` runs its kernels here (on CUDA with Triton) rather than torch ops."""
    return triton is not None and qkv.is_cuda and cos.is_cuda


@torch.library.custom_op("tessera::rotary_qkv", mutates_args=())
def rotary_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
               groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) from qkv [b, s, (heads + 2 groups) d], q and k rotated by cos and sin."""
    batch, seq, width = qkv.shape
    d = width // (heads + 2 * groups)
    q, k, v = (t.view(batch, seq, -1, d) for t in qkv.split([heads * d, groups * d, groups * d], dim=-1))
    if not rotary_qkv_applies(qkv, cos):   # v copied even where contiguous: no output may alias qkv
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone(memory_format=torch.contiguous_format)
    outputs = tuple(qkv.new_empty(t.shape) for t in (q, k, v))
    tables = _kernel_tables(cos, sin, batch, seq)
    for source, target, rotate in zip((q, k, v), outputs, (True, True, False)):
        _rotate(source, target, tables, rotate=rotate, inverse=False)
    return outputs


@rotary_qkv.register_fake
def _(qkv, cos, sin, heads, groups):
    batch, seq, width = qkv.shape
    d = width // (heads + 2 * groups)
    return tuple(qkv.new_empty(batch, seq, n, d) for n in (heads, groups, groups))


@torch.library.custom_op("tessera::rotary_qkv_backward", mutates_args=())
def rotary_qkv_backward(d_q: torch.Tensor, d_k: torch.Tensor, d_v: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """d qkv [b, s, (heads + 2 groups) d]: d q and d k rotated back, d v beside them."""
    batch, seq = d_q.shape[:2]
    widths = [t.shape[2] * t.shape[3] for t in (d_q, d_k, d_v)]
    if not rotary_qkv_applies(d_q, cos):
        parts = (_rotate_back(d_q, cos, sin), _rotate_back(d_k, cos, sin), d_v)
        return torch.cat([p.reshape(batch, seq, -1) for p in parts], dim=-1)
    d_qkv = d_q.new_empty(batch, seq, sum(widths))
    tables = _kernel_tables(cos, sin, batch, seq)
    for source, target, rotate in zip((d_q, d_k, d_v), d_qkv.split(widths, dim=-1), (True, True, False)):
        _rotate(source, target.view(source.shape), tables, rotate=rotate, inverse=True)
    return d_qkv


@rotary_qkv_backward.register_fake
def _(d_q, d_k, d_v, cos, sin):
    return d_q.new_empty(*d_q.shape[:2], sum(t.shape[2] * t.shape[3] for t in (d_q, d_k, d_v)))


def _save_tables(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _backward(ctx, d_q, d_k, d_v):
    return rotary_qkv_backward(d_q, d_k, d_v, *ctx.saved_tensors), None, None, None, None


rotary_qkv.register_autograd(_backward, setup_context=_save_tables)


def _rotate_back(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's input gradient (its transpose) in torch ops: for the pair (i, i + d/2),
    d x_i = g_i cos_i + g_{i+d/2} sin_{i+d/2} and d x_{i+d/2} = g_{i+d/2} cos_{i+d/2} - g_i sin_i."""
    cos, sin = cos.to(grad.dtype), sin.to(grad.dtype)
    first, second = grad.chunk(2, dim=-1)
    sin_first, sin_second = sin.chunk(2, dim=-1)
    return grad * cos + torch.cat([second * sin_second, -first * sin_first], dim=-1)


def _kernel_tables(cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int) -> list[torch.Tensor]:
    """cos and sin as [b, s, 1, d] (stride 0 over a batch they share), channels contiguous."""
    tables = [(t if t.dim() == 4 else t.unsqueeze(0)).expand(batch, seq, 1, t.shape[-1]) for t in (cos, sin)]
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tables]


def _rotate(source: torch.Tensor, target: torch.Tensor, tables: list[torch.Tensor], *, rotate: bool,
            inverse: bool) -> None:
    """target [b, s, n, d] = source rotated (or its gradient rotated back, `inverse`), or copied."""
    if source.stride(-1) != 1:
        source = source.contiguous()
    batch, seq, heads, d = source.shape
    tokens = batch * seq
    if not tokens or not heads:
        return
    _rotate_kernel[(triton.cdiv(tokens, ROWS),)](
        source, target, *tables, tokens, seq, heads, *source.stride()[:3], *target.stride()[:3],
        *tables[0].stride()[:2], *tables[1].stride()[:2],
        HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), ROWS=ROWS, ROTATE=rotate, INVERSE=inverse)


if triton is not None:
    @triton.jit
    def _rotate_kernel(source, target, cos, sin, tokens, seq, heads, src_b, src_s, src_h, dst_b, dst_s, dst_h,
                       cos_b, cos_s, sin_b, sin_s, HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       ROTATE: tl.constexpr, INVERSE: tl.constexpr):
        """ROWS tokens, every head in turn, each as its two halves x1 (channels < HALF) and x2."""
        token = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        b, s = (token // seq).to(tl.int64), (token % seq).to(tl.int64)
        d = tl.arange(0, BLOCK)[None, :]
        mask = (token < tokens)[:, None] & (d < HALF)
        if ROTATE:   # the tables once for all heads, rounded as apply_rotary rounds them
            dtype = target.dtype.element_ty
            cos_row, sin_row = (b * cos_b + s * cos_s)[:, None] + d, (b * sin_b + s * sin_s)[:, None] + d
            c1 = tl.load(cos + cos_row, mask=mask, other=0.0).to(dtype).to(tl.float32)
            c2 = tl.load(cos + cos_row + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
            s1 = tl.load(sin + sin_row, mask=mask, other=0.0).to(dtype).to(tl.float32)
            s2 = tl.load(sin + sin_row + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
        src_row, dst_row = (b * src_b + s * src_s)[:, None] + d, (b * dst_b + s * dst_s)[:, None] + d
        for head in tl.range(0, heads):
            x1 = tl.load(source + src_row + head * src_h, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(source + src_row + head * src_h + HALF, mask=mask, other=0.0).to(tl.float32)
            if ROTATE:
                if INVERSE:   # the transpose: d x1 = g1 c1 + g2 s2, d x2 = g2 c2 - g1 s1
                    x1, x2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
                else:         # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
                    x1, x2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
            tl.store(target + dst_row + head * dst_h, x1.to(target.dtype.element_ty), mask=mask)
            tl.store(target + dst_row + head * dst_h + HALF, x2.to(target.dtype.element_ty), mask=mask)

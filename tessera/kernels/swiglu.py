"""SwiGLU in one pass each way: the MoE experts' (weighted by the routing probabilities) and the
dense MLP's (fused into fc2's GEMM by tessera.kernels.activation_linear).

    out = weighted_swiglu(hidden, probs)          # SiLU(gate) * up * probs[:, None], hidden = [gate | up]
    act = swiglu_forward(hidden)                  # SiLU(gate) * up
    d_hidden, act = swiglu_backward(grad, hidden) # and the activation again, for fc2's weight gradient

hidden [rows, 2 ffn] is fc1's output. Both compute in fp32 and round to hidden's dtype.

The experts: probs [rows] fp32 is each row's routing weight (Megatron scales the rows after
the activation, before fc2). torch.compile made its backward two passes over fc1's output,
one for d hidden and one for d probs, together 4.6 ms of config M's 111 ms step on an H200
(~1.8 TB/s). Here one Triton kernel reads gate, up and the output's gradient once and writes
d gate, d up and d probs (1.4 ms; M's step 1.025x faster).

The dense MLP: compiled, its backward was one kernel at ~2.5 TB/s over gate, up and d act,
writing d gate, d up and the activation again for fc2's weight gradient (10.5 ms of config
B's 226 ms of kernels). The fused fc2 keeps fc1's output, not the activation, and its
backward's kernel here does the same work in one Triton pass. Without CUDA and Triton the same
maths runs in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch ships without Triton
    triton = None

ROWS, BLOCK = 8, 256   # a program's tile: rows x ffn columns


def on_triton(hidden: torch.Tensor) -> bool:
    return triton is not None and hidden.is_cuda


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)   # fp64 under --moe-router-dtype fp64


def swiglu(hidden: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of hidden = [gate | up] in torch ops (autograd, autocast, compile fuse it)."""
    gate, up = hidden.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- the experts' activation, weighted by the routing probabilities -------------------------

@torch.library.custom_op("tessera::weighted_swiglu", mutates_args=())
def weighted_swiglu(hidden: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """hidden [rows, 2 ffn], probs [rows] -> SiLU(gate) * up * probs [rows, ffn] in hidden's dtype."""
    if not on_triton(hidden):
        return (swiglu(hidden.to(compute_dtype(probs))) * probs.unsqueeze(-1)).to(hidden.dtype)
    return _forward(hidden, probs)


@weighted_swiglu.register_fake
def _(hidden, probs):
    return hidden.new_empty(hidden.shape[0], hidden.shape[1] // 2)


@torch.library.custom_op("tessera::weighted_swiglu_backward", mutates_args=())
def weighted_swiglu_backward(grad: torch.Tensor, hidden: torch.Tensor,
                             probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weighted_swiglu's input gradients: (d hidden [rows, 2 ffn] in hidden's dtype, d probs [rows], fp32 or fp64)."""
    if not on_triton(hidden):
        gate, up = hidden.to(compute_dtype(probs)).chunk(2, dim=-1)
        grad = grad.to(gate.dtype)
        d_gate, d_up = _gate_and_up_gradients(grad * probs.unsqueeze(-1), gate, up)
        d_probs = (grad * (gate * torch.sigmoid(gate) * up)).sum(dim=-1)
        return torch.cat([d_gate, d_up], dim=-1).to(hidden.dtype), d_probs
    rows, ffn = hidden.shape[0], hidden.shape[1] // 2
    d_hidden, d_probs = torch.empty_like(hidden), hidden.new_empty(rows, dtype=compute_dtype(probs))
    if rows:
        _weighted_backward_kernel[(triton.cdiv(rows, ROWS),)](
            grad.contiguous(), hidden.contiguous(), probs.contiguous(), d_hidden, d_probs, rows, ffn,
            ROWS=ROWS, BLOCK=BLOCK)
    return d_hidden, d_probs


@weighted_swiglu_backward.register_fake
def _(grad, hidden, probs):
    return torch.empty_like(hidden), hidden.new_empty(hidden.shape[0], dtype=compute_dtype(probs))


def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return weighted_swiglu_backward(grad, *ctx.saved_tensors)


weighted_swiglu.register_autograd(_backward, setup_context=_save)


# -- the dense MLP's activation, fused into fc2 ---------------------------------------------

@torch.library.custom_op("tessera::swiglu_forward", mutates_args=())
def swiglu_forward(hidden: torch.Tensor) -> torch.Tensor:
    """hidden [rows, 2 ffn] -> SiLU(gate) * up [rows, ffn] in hidden's dtype."""
    if not on_triton(hidden):
        return swiglu(hidden.to(compute_dtype(hidden))).to(hidden.dtype)
    return _forward(hidden, None)


@swiglu_forward.register_fake
def _(hidden):
    return hidden.new_empty(hidden.shape[0], hidden.shape[1] // 2)


@torch.library.custom_op("tessera::swiglu_backward", mutates_args=())
def swiglu_backward(grad: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d hidden [rows, 2 ffn], the activation [rows, ffn] recomputed), both in hidden's dtype."""
    if not on_triton(hidden):
        gate, up = hidden.to(compute_dtype(hidden)).chunk(2, dim=-1)
        d_gate, d_up = _gate_and_up_gradients(grad.to(gate.dtype), gate, up)
        return torch.cat([d_gate, d_up], dim=-1).to(hidden.dtype), (F.silu(gate) * up).to(hidden.dtype)
    rows, ffn = hidden.shape[0], hidden.shape[1] // 2
    d_hidden, act = torch.empty_like(hidden), hidden.new_empty(rows, ffn)
    if rows:
        _backward_kernel[(triton.cdiv(rows, ROWS), triton.cdiv(ffn, BLOCK))](
            grad.contiguous(), hidden.contiguous(), d_hidden, act, rows, ffn, ROWS=ROWS, BLOCK=BLOCK)
    return d_hidden, act


@swiglu_backward.register_fake
def _(grad, hidden):
    return torch.empty_like(hidden), hidden.new_empty(hidden.shape[0], hidden.shape[1] // 2)


def _gate_and_up_gradients(d_act: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """d gate and d up of SiLU(gate) * up, given d act (torch's path; the kernels inline it)."""
    sigmoid = torch.sigmoid(gate)
    return d_act * up * (sigmoid * (1 + gate * (1 - sigmoid))), d_act * (gate * sigmoid)


def _forward(hidden: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
    rows, ffn = hidden.shape[0], hidden.shape[1] // 2
    out = hidden.new_empty(rows, ffn)
    if rows:
        weighted = probs is not None
        _forward_kernel[(triton.cdiv(rows, ROWS), triton.cdiv(ffn, BLOCK))](
            hidden.contiguous(), probs.contiguous() if weighted else hidden, out, rows, ffn,
            WEIGHTED=weighted, ROWS=ROWS, BLOCK=BLOCK)
    return out


if triton is not None:
    @triton.jit
    def _tile(hidden, row, col, rows, ffn: tl.constexpr):
        """gate and up (fp32) of a tile, its mask and gate's offsets."""
        mask = (row < rows)[:, None] & (col < ffn)[None, :]
        gate_at = row.to(tl.int64)[:, None] * 2 * ffn + col[None, :]
        gate = tl.load(hidden + gate_at, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(hidden + gate_at + ffn, mask=mask, other=0.0).to(tl.float32)
        return gate, up, mask, gate_at

    @triton.jit
    def _forward_kernel(hidden, probs, out, rows, ffn: tl.constexpr, WEIGHTED: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        gate, up, mask, _ = _tile(hidden, row, col, rows, ffn)
        value = gate * tl.sigmoid(gate) * up
        if WEIGHTED:
            value *= tl.load(probs + row, mask=row < rows, other=0.0)[:, None]
        tl.store(out + row.to(tl.int64)[:, None] * ffn + col[None, :], value.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _backward_kernel(grad, hidden, d_hidden, act, rows, ffn: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        gate, up, mask, gate_at = _tile(hidden, row, col, rows, ffn)
        act_at = row.to(tl.int64)[:, None] * ffn + col[None, :]
        g = tl.load(grad + act_at, mask=mask, other=0.0).to(tl.float32)
        sigmoid = tl.sigmoid(gate)
        silu = gate * sigmoid
        tl.store(d_hidden + gate_at, (g * up * (sigmoid * (1 + gate * (1 - sigmoid)))).to(d_hidden.dtype.element_ty),
                 mask=mask)
        tl.store(d_hidden + gate_at + ffn, (g * silu).to(d_hidden.dtype.element_ty), mask=mask)
        tl.store(act + act_at, (silu * up).to(act.dtype.element_ty), mask=mask)

    @triton.jit
    def _weighted_backward_kernel(grad, hidden, probs, d_hidden, d_probs, rows, ffn: tl.constexpr,
                                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        weight = tl.load(probs + row, mask=row < rows, other=0.0)
        d_weight = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, ffn, BLOCK):   # a row's columns in turn: d probs is a sum over all of them
            col = start + tl.arange(0, BLOCK)
            gate, up, mask, gate_at = _tile(hidden, row, col, rows, ffn)
            g = tl.load(grad + row.to(tl.int64)[:, None] * ffn + col[None, :], mask=mask, other=0.0).to(tl.float32)
            sigmoid = tl.sigmoid(gate)
            silu = gate * sigmoid
            d_weight += tl.sum(g * (silu * up), axis=1)
            d_act = g * weight[:, None]
            d_gate = d_act * up * (sigmoid * (1 + gate * (1 - sigmoid)))
            tl.store(d_hidden + gate_at, d_gate.to(d_hidden.dtype.element_ty), mask=mask)
            tl.store(d_hidden + gate_at + ffn, (d_act * silu).to(d_hidden.dtype.element_ty), mask=mask)
        tl.store(d_probs + row, d_weight, mask=row < rows)

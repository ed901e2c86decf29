"""Tensor-parallel GEMMs overlapped with their sequence-parallel collectives (--tp-comm-overlap).

Under sequence parallelism a column-parallel linear all-gathers its sequence-sharded input
before its GEMM and a row-parallel linear reduce-scatters its partial output after it
(tessera.parallel.tensor). Here each pair is one "collective matmul": the work is cut into TP
chunks along the sequence, passed round the ring of TP ranks, and a chunk travels while
another chunk's GEMM runs.

    all-gather + GEMM      each rank multiplies the shard it holds while passing it to the next
                           rank and receiving the previous rank's; after TP steps it has
                           multiplied every rank's shard
    GEMM + reduce-scatter  each rank computes its partial output for one rank's chunk, adds the
                           running sum received from the previous rank and passes it on, while
                           it computes the next; after TP steps the sum that arrives is complete
                           and is this rank's own chunk

Backward is the conjugate. The input gradient of all-gather + GEMM is a GEMM + reduce-scatter;
meanwhile an asynchronous all-gather brings the input back for the weight gradient (only the
shard is kept between forward and backward, as Megatron does under SP). The input gradient of
GEMM + reduce-scatter is an all-gather + GEMM, whose gathered output gradient then gives the
weight gradient. Chunked sums add the same products in another order than one GEMM and one
collective: results agree to rounding.

Why by hand: PyTorch's own async TP (torch.distributed._symmetric_memory's
fused_all_gather_matmul / fused_matmul_reduce_scatter, which Inductor's _micro_pipeline_tp pass
puts into compiled graphs) registers CUDA kernels only: they work in symmetric-memory buffers
that the peer GPUs read directly (one NVLink domain), and they have no autograd. Nothing of it
runs on gloo. These functions use torch.distributed's point-to-point ops, which every backend
has, so the CPU tests prove them equal to the unchunked layers.

Activations are [batch, seq, features]; the sequence dimension is 1.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tessera.parallel.collectives import all_gather_flat
from tessera.parallel.context import Ring

SEQUENCE_DIM = 1


# -- the chunked collectives -------------------------------------------------------------


def _gather_matmul(shard: torch.Tensor, matmul, group, *, keep_gathered: bool = False):
    """matmul(all-gather of `shard` along the sequence), computed shard by shard as the shards
    come round the ring; returns it and, with `keep_gathered`, the gathered tensor."""
    ring = Ring(group)
    outputs, shards = [None] * ring.size, [None] * ring.size
    current = shard.contiguous()
    for step in range(ring.size):
        source = (ring.rank - step) % ring.size   # whose shard this rank holds now
        in_flight = ring.send_on(current) if step < ring.size - 1 else None
        outputs[source] = matmul(current)
        if keep_gathered:
            shards[source] = current
        if in_flight is not None:
            current = ring.receive(in_flight)
    gathered = torch.cat(shards, dim=SEQUENCE_DIM) if keep_gathered else None
    return torch.cat(outputs, dim=SEQUENCE_DIM), gathered


def _matmul_reduce_scatter(full: torch.Tensor, matmul, group) -> torch.Tensor:
    """This rank's sequence chunk of matmul(`full`) summed over the ranks: each rank computes its
    part of one rank's chunk, adds the sum received so far and passes it on."""
    ring = Ring(group)
    if full.shape[SEQUENCE_DIM] % ring.size:
        raise ValueError(f"sequence of {full.shape[SEQUENCE_DIM]} does not split over {ring.size} ranks")
    chunks = full.chunk(ring.size, dim=SEQUENCE_DIM)
    in_flight = None
    for step in range(ring.size):
        # The sum for rank t starts at rank t + 1 and ends, after TP steps, at rank t.
        target = (ring.rank - step - 1) % ring.size
        total = matmul(chunks[target])
        if in_flight is not None:
            total = total + ring.receive(in_flight)
        if step < ring.size - 1:
            in_flight = ring.send_on(total.contiguous())
    return total


def _start_all_gather(shard: torch.Tensor, group):
    """An asynchronous all-gather of `shard` along the sequence; call the result to wait for it."""
    size = dist.get_world_size(group)
    rows = shard.contiguous()
    stacked = rows.new_empty((size * rows.shape[0], *rows.shape[1:]))   # ranks' shards along dim 0
    work = all_gather_flat(stacked, rows, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return torch.cat(stacked.chunk(size), dim=SEQUENCE_DIM)
    return wait


# -- autograd ----------------------------------------------------------------------------

def _autocast_state(device_type: str) -> tuple:
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


def _autocast(state: tuple):
    """Backward's GEMMs in the precision forward's ran in (autograd does not carry autocast over)."""
    device_type, dtype, enabled = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


def _weight_grad(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (grad_output.flatten(0, -2).t() @ input.flatten(0, -2)).to(weight.dtype)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, weight, bias, group):
        ctx.save_for_backward(shard, weight)
        ctx.group, ctx.autocast = group, _autocast_state(shard.device.type)
        ctx.bias_dtype = None if bias is None else bias.dtype
        # The bias inside the GEMM, as F.linear: under autocast it is added in the GEMM's precision.
        output, _ = _gather_matmul(shard, lambda chunk: F.linear(chunk, weight, bias), group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        with _autocast(ctx.autocast):
            gathered = _start_all_gather(shard, ctx.group)   # runs under the input-gradient GEMMs
            grad_input = _matmul_reduce_scatter(grad_output, lambda chunk: (chunk @ weight).to(shard.dtype),
                                                ctx.group)
            grad_weight = _weight_grad(grad_output, gathered(), weight)
        grad_bias = None if ctx.bias_dtype is None else grad_output.flatten(0, -2).sum(0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, group):
        ctx.save_for_backward(input, weight)
        ctx.group, ctx.autocast = group, _autocast_state(input.device.type)
        return _matmul_reduce_scatter(input, lambda chunk: F.linear(chunk, weight), group)

    @staticmethod
    def backward(ctx, grad_shard):
        input, weight = ctx.saved_tensors
        with _autocast(ctx.autocast):
            grad_input, grad_output = _gather_matmul(grad_shard, lambda chunk: (chunk @ weight).to(input.dtype),
                                                     ctx.group, keep_gathered=True)
            grad_weight = _weight_grad(grad_output, input, weight)
        return grad_input, grad_weight, None


def _split_over(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def all_gather_matmul(shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    """all_gather(shard) W^T + b, the gather along the sequence overlapped with the GEMM:
    shard [b, s / TP, in], W [out, in] and b [out] (this rank's rows) -> [b, s, out]."""
    if not _split_over(group):
        return F.linear(shard, weight, bias)
    return _AllGatherMatmul.apply(shard, weight, bias, group)


def matmul_reduce_scatter(input: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """reduce_scatter(input W^T), the sum over ranks and split along the sequence overlapped with
    the GEMM: input [b, s, in / TP], W [out, in / TP] -> [b, s / TP, out]."""
    if not _split_over(group):
        return F.linear(input, weight)
    return _MatmulReduceScatter.apply(input, weight, group)


@functools.cache
def eager(fn):
    """`fn` (all_gather_matmul or matmul_reduce_scatter) as compiled blocks must call it: eagerly,
    since Dynamo cannot trace point-to-point ops. Taken when a layer is built, not at import:
    torch.compiler loads torch._dynamo, ~2 s that every command loading a model would pay."""
    return torch.compiler.disable(fn)

"""Context parallelism (CP): causal attention over a sequence split across ranks.

Each rank holds 2 of the 2 x CP chunks of every sample (tessera.parallel.context_split);
everything but attention runs on those tokens alone. Attention needs every earlier
token, and --cp-comm-type says how a rank gets them (Megatron's and TE's four ways):

    p2p         ring attention: keys and values go round the CP ranks; the next block is in
                flight while this one is attended. Partial results are merged by their
                log-sum-exp; in the backward the ring turns again, carrying each block's
                dK, dV with it until they are home.
    all_gather  keys and values all-gathered, the same blocks attended; dK, dV reduce-scattered.
    a2a         Ulysses: an all-to-all trades heads for sequence, so each rank attends its
                1/CP of the heads over the whole sequence with the ordinary kernels, and a
                second all-to-all trades back (heads and KV groups must divide by CP).
    a2a+p2p     the all-to-all inside each group of --hierarchical-context-parallel-sizes'
                first size (neighbouring ranks, NVLink), the ring across the groups.

Blocks are exact: softmax(q k^T) v of a block with its log-sum-exp, and the backward of a
block given the merged output and log-sum-exp (P = exp(s - lse_merged) is each block's
share of the final softmax, so its gradients are exact partial sums). The kernels are
PyTorch's own SDPA ops that return the log-sum-exp: the CPU flash kernel (fp32, bf16), CUDA
FlashAttention for fp16/bf16, plain matrix products otherwise (fp32 on a GPU; [s, s] scores
per block, for tests). Accumulators are fp32. The CUDA branch has not been run in CI (CPU
only); tests/gpu/test_context_cuda.py checks it on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from tessera.parallel.collectives import all_gather_flat, reduce_scatter_flat
from tessera.parallel.context_split import Piece, SplitDocuments, ZigzagSplit
from tessera.parallel.sharding import rank_and_size


@dataclass(frozen=True)
class ContextParallel:
    """A rank's context-parallel groups and each layer's --cp-comm-type."""

    comm_types: tuple[str, ...]   # one for every layer, or one per layer
    group: Any = None             # all CP ranks of this rank's sample
    inner_group: Any = None       # a2a+p2p: the all-to-all group (neighbouring CP ranks)
    outer_group: Any = None       # a2a+p2p: the ring across the inner groups

    @property
    def size(self) -> int:
        return rank_and_size(self.group)[1]

    @property
    def rank(self) -> int:
        return rank_and_size(self.group)[0]

    def layer(self, index: int) -> "ContextAttention":
        """What layer `index` (global) uses."""
        return ContextAttention(self.comm_types[index if len(self.comm_types) > 1 else 0], self)

    def local_positions(self, local_length: int, device: torch.device) -> torch.Tensor:
        """Position ids [1, local_length] of this rank's tokens of a whole (unpacked) sample."""
        return ZigzagSplit.uniform(self.size, local_length * self.size).positions(self.rank).to(device)


class ContextAttention:
    """One layer's context-parallel attention."""

    def __init__(self, comm_type: str, parallel: ContextParallel):
        self.comm_type, self.parallel = comm_type, parallel
        # Collectives in a Python loop over blocks: kept out of compiled graphs. Wrapped here,
        # not at import: torch.compiler loads torch._dynamo (a second at every process start).
        self.attend = torch.compiler.disable(self._attend)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: SplitDocuments | None, *,
                scale: float | None, full_attention: Callable) -> torch.Tensor:
        """Causal attention of this rank's queries [b, heads, local, d] over the whole sample
        (within each document when given); k, v [b, groups, local, d]. `full_attention(q, k, v,
        documents)` is the single-process kernel, for a2a's whole sequences. (As `attend`.)"""
        cp = self.parallel
        split = documents.split if documents is not None else ZigzagSplit.uniform(cp.size, q.shape[2] * cp.size)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if self.comm_type in ("p2p", "all_gather"):
            return _BlockAttention.apply(q, k, v, split, cp.group, scale, self.comm_type == "all_gather")
        inner = cp.group if self.comm_type == "a2a" else cp.inner_group
        outer = None if self.comm_type == "a2a" else cp.outer_group
        inner_size, outer_rank = rank_and_size(inner)[1], rank_and_size(outer)[0]
        order = split.gather_order(outer_rank, inner_size, q.device)
        q, k, v = (_reorder(_heads_to_sequence(t, inner), order) for t in (q, k, v))
        if self.comm_type == "a2a":
            out = full_attention(q, k, v, documents.whole if documents is not None else None)
        else:   # the ring across the groups (of one rank when the second hierarchical size is 1)
            out = _BlockAttention.apply(q, k, v, split.coarsen(inner_size), outer, scale, False)
        return _sequence_to_heads(_reorder(out, order.argsort(dim=1)), inner)


# -- ring and all-gather attention ------------------------------------------------------------

class _BlockAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys, block by block (p2p or all_gather)."""

    @staticmethod
    def forward(ctx, q, k, v, split: ZigzagSplit, group, scale: float, gather: bool):
        rank, _ = rank_and_size(group)
        sources = _gathered(k, v, group) if gather else Ring(group).around(k, v)
        out, lse = attend_blocks(q, sources, split, rank, scale, v.shape[-1])
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.group, ctx.scale, ctx.gather = split, group, scale, gather
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        split, group, scale = ctx.split, ctx.group, ctx.scale
        rank, size = rank_and_size(group)
        dq = torch.zeros_like(q, dtype=torch.float32)
        blocks = BlockGradients(dout.contiguous(), q, out, lse, split, rank, scale, dq)
        if ctx.gather:
            # every rank's dK, dV of this rank's queries, then each summed over the ranks at its owner
            grads = torch.zeros(size, k.numel() + v.numel(), dtype=torch.float32, device=q.device)
            for source, (k_s, v_s) in _gathered(k, v, group):
                blocks.add(source, k_s, v_s, *_unpack(grads[source], k, v))
            own = grads.new_empty(grads.shape[1])
            reduce_scatter_flat(own, grads.flatten(), group=group)
        else:
            # dK, dV travel one hop behind their K, V; after the last hop they are home
            ring, travelling = Ring(group), None
            for source, (k_s, v_s) in ring.around(k, v):
                grads = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=q.device)
                blocks.add(source, k_s, v_s, *_unpack(grads, k, v))
                if travelling is not None:
                    grads += ring.receive(travelling)   # the share of the ranks before this one
                travelling = ring.send_on(grads, tag=1)
            own = ring.receive(travelling)
        dk, dv = _unpack(own, k, v)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def attend_blocks(q: torch.Tensor, sources, split: ZigzagSplit, rank: int, scale: float, value_width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (fp32) and log-sum-exp of `rank`'s queries over the keys and values of each
    (source rank, (k, v)) in `sources`, merged block by block."""
    out = q.new_zeros((*q.shape[:-1], value_width), dtype=torch.float32)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    for source, (k, v) in sources:
        for piece in split.pieces(rank, source):
            rows, qs, ks = _rows(piece), _queries(piece), _keys(piece)
            part, part_lse = block_forward(q[rows, :, qs], k[rows, :, ks], v[rows, :, ks], piece.causal, scale)
            merge_partial(out[rows, :, qs], lse[rows, :, qs], part, part_lse)
    return out, lse


@dataclass
class BlockGradients:
    """The backward of `attend_blocks`, one source at a time: dq accumulates here, each source's
    dk, dv into the tensors given with it (fp32)."""

    dout: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor   # the merged output and log-sum-exp of the forward
    lse: torch.Tensor
    split: ZigzagSplit
    rank: int
    scale: float
    dq: torch.Tensor

    def add(self, source: int, k, v, dk, dv) -> None:
        for piece in self.split.pieces(self.rank, source):
            rows, qs, ks = _rows(piece), _queries(piece), _keys(piece)
            grads = block_backward(self.dout[rows, :, qs], self.q[rows, :, qs], k[rows, :, ks], v[rows, :, ks],
                                   self.out[rows, :, qs], self.lse[rows, :, qs], piece.causal, self.scale)
            for total, grad, where in zip((self.dq, dk, dv), grads, (qs, ks, ks)):
                total[rows, :, where] += grad


class Ring:
    """Point-to-point exchanges with the next and previous rank of a group (CP's ring attention,
    the TP ring of tessera.parallel.tp_overlap)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.size = rank_and_size(group)
        self.next, self.previous = (dist.get_global_rank(group, (self.rank + step) % self.size)
                                    if group is not None else 0 for step in (1, -1))

    def send_on(self, tensor: torch.Tensor, tag: int = 0) -> tuple:
        """Start sending `tensor` to the next rank and receiving the previous rank's; a handle.
        (Blocks of K, V and of their gradients are in flight together: tags keep them apart.)"""
        if self.size == 1:
            return tensor.clone(), []
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                                        dist.P2POp(dist.irecv, received, self.previous, self.group, tag)])
        return received, works

    @staticmethod
    def receive(handle: tuple) -> torch.Tensor:
        received, works = handle
        for work in works:
            work.wait()
        return received

    def around(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[tuple[int, tuple]]:
        """(source rank, its K and V) for every rank, this one first; each next block is in
        flight while the caller works on the current one."""
        block = _pack(k, v)
        for step in range(self.size):
            handle = self.send_on(block) if step < self.size - 1 else None
            yield (self.rank - step) % self.size, _unpack(block, k, v)
            if handle is not None:
                block = self.receive(handle)


def _gathered(k: torch.Tensor, v: torch.Tensor, group) -> Iterator[tuple[int, tuple]]:
    """(source rank, its K and V) for every rank, from one all-gather."""
    block = _pack(k, v)
    size = rank_and_size(group)[1]
    blocks = block.new_empty(size * block.numel())
    if group is None:
        blocks.copy_(block)
    else:
        all_gather_flat(blocks, block, group=group)
    for source, flat in enumerate(blocks.view(size, -1)):
        yield source, _unpack(flat, k, v)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed K, V block shaped like k and v."""
    return flat[:k.numel()].view(k.shape), flat[k.numel():].view(v.shape)


def _rows(piece: Piece) -> slice:
    return slice(None) if piece.row is None else slice(piece.row, piece.row + 1)


def _queries(piece: Piece) -> slice:
    return slice(piece.q_start, piece.q_start + piece.q_len)


def _keys(piece: Piece) -> slice:
    return slice(piece.kv_start, piece.kv_start + piece.kv_len)


def merge_partial(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a block's output and log-sum-exp into the running ones (fp32 views, in place)."""
    merged = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1)).add_(part * torch.exp(part_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# -- all-to-all between heads and sequence ------------------------------------------------------

def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[b, heads, s, d] -> [b, heads / size, size x s, d]: this rank's share of the heads, with
    every rank's tokens side by side in rank order."""
    size = rank_and_size(group)[1]
    if size == 1:
        return x
    b, heads, s, d = x.shape
    sent = x.reshape(b, size, heads // size, s, d).transpose(0, 1).contiguous()   # by destination rank
    received = all_to_all_single_autograd(sent, None, None, group)                # by source rank
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * s, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`."""
    size = rank_and_size(group)[1]
    if size == 1:
        return x
    b, heads, total, d = x.shape
    sent = x.reshape(b, heads, size, total // size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all_single_autograd(sent, None, None, group)
    return received.transpose(0, 1).reshape(b, size * heads, total // size, d)


def _reorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x[:, :, order] along the sequence, per row when `order` has a row per sample."""
    if order.shape[0] == 1:
        return x[:, :, order[0]]
    return x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


# -- one block: output and log-sum-exp, and its backward -----------------------------------------

def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v [b, heads, s_q, d_v] and its log-sum-exp (fp32 [b, heads, s_q]);
    causal: query i sees keys 0..i (s_q = s_k). k, v may have fewer heads (GQA). `kernel`:
    "cpu", "cuda" or "math" (default: the device's)."""
    q, k, v, width = _same_width(q, k, v)
    kernel = kernel or _kernel(q)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif kernel == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, *_expand_groups(q, k, v), 0.0, causal, False, scale=scale)
    else:
        k_all, v_all = _expand_groups(q, k, v)
        scores = _scores(q, k_all, causal, scale)
        lse = scores.logsumexp(dim=-1)
        out = (torch.exp(scores - lse.unsqueeze(-1)) @ v_all.float()).to(v.dtype)
    return out[..., :width], lse.float()


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, kernel: str | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of one block given the merged output and log-sum-exp of its queries."""
    groups, q_width, v_width = k.shape[1], q.shape[-1], v.shape[-1]
    q, k, v, _ = _same_width(q, k, v)
    dout, out = (_pad_to(t, q.shape[-1]).contiguous() for t in (dout, out))
    lse = lse.contiguous()
    kernel = kernel or _kernel(q)
    if kernel == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif kernel == "cuda":
        # No variable lengths (None: the kernel checks defined cumulative lengths for int32) and
        # no dropout (the RNG state goes unread).
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, *_expand_groups(q, k, v), out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
            unused, unused, scale=scale)
        dk, dv = (_sum_groups(t, groups) for t in (dk, dv))
    else:
        k_all, v_all = _expand_groups(q, k, v)
        probs = torch.exp(_scores(q, k_all, causal, scale) - lse.unsqueeze(-1))
        dp = dout.float() @ v_all.float().transpose(-1, -2)
        ds = probs * (dp - (dout.float() * out.float()).sum(-1, keepdim=True)) * scale
        dq = ds @ k_all.float()
        dk, dv = (_sum_groups(t, groups) for t in (ds.transpose(-1, -2) @ q.float(),
                                                   probs.transpose(-1, -2) @ dout.float()))
    return dq[..., :q_width], dk[..., :q_width], dv[..., :v_width]


def _kernel(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu"
    return "cuda" if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else "math"


def _same_width(q, k, v):
    """q, k, v with one head width (the fused kernels' rule; MLA's values are narrower): the
    narrower side zero-padded, which changes neither scores nor outputs. Also the values' width."""
    width = max(q.shape[-1], v.shape[-1])
    return (*(_pad_to(t, width).contiguous() for t in (q, k, v)), v.shape[-1])


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _expand_groups(q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with one head per query head (GQA's groups repeated)."""
    repeats = q.shape[1] // k.shape[1]
    return (k, v) if repeats == 1 else (k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1))


def _sum_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradients of repeated KV heads summed back onto their groups."""
    b, heads, s, d = grad.shape
    return grad if heads == groups else grad.view(b, groups, heads // groups, s, d).sum(2)


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores

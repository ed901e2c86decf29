"""Expert parallelism: where a MoE layer's tokens are sent to their experts, and brought back.

The router gives each of this rank's tokens k (token, expert, weight) pairs (`Routing`).
A dispatcher turns them into the rows this rank's experts compute, grouped by expert
(`dispatch`), and puts the experts' outputs back on the tokens they came from, summed
over each token's experts (`combine`). Experts are split over the expert-parallel (EP)
group, E / EP contiguous experts per rank, and each expert over the expert-tensor-parallel
(ETP) group, whose ranks each compute partial sums of every row.

    local      EP = ETP = 1: sort the pairs by expert, gather the rows; no communication.
    allgather  all-gather every token and pair of the ETP x EP group, keep the pairs of this
               rank's experts; combine reduce-scatters the partial outputs back to their
               owners (Megatron's default dispatcher; the bytes grow with EP).
    alltoall   all-gather over ETP, then send each pair's row to the EP rank of its expert and
               receive the rows for this rank's experts (all-to-all with per-rank counts:
               one device-to-host sync per layer); combine runs it backwards.

Tokens and their weights travel through autograd collectives (backward is the conjugate
collective), so the router and the experts get the gradients a single process computes.
With sequence parallelism every TP rank holds its own tokens: that is why MoE needs
--sequence-parallel when TP > 1. The dropless local path has static shapes and no
device-to-host sync, so a compiled block keeps it in one graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tessera.kernels.pair_sum import sum_pairs, sum_pairs_in_torch
from tessera.parallel.collectives import all_gather_flat
from tessera.parallel.sharding import rank_and_size
from tessera.parallel.tensor import all_gather_tokens, reduce_scatter_tokens


@dataclass
class Routing:
    """Which experts this rank's tokens go to: one (token, expert, weight) triple per pair."""

    token_index: torch.Tensor    # [P] int64, into this rank's [num_tokens] tokens
    expert_index: torch.Tensor   # [P] int64, global expert ids
    probs: torch.Tensor          # [P] fp32 routing weights (differentiable)
    num_tokens: int
    per_token: int | None = None   # k when the pairs are every token's k choices, token-major (dropless)
    same_size: bool = True         # every rank has as many pairs (not so after capacity drops)


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups a MoE layer uses (None where a dimension has one rank)."""

    ep: object = None        # expert parallel: ranks holding different experts
    etp: object = None       # expert tensor parallel: ranks holding pieces of the same experts
    tp_ep: object = None     # both (the allgather dispatcher's group)
    loss: object = None      # the ranks sharing one micro-batch (TP x CP): load-balancing counts
    stage: object = None     # every rank of the pipeline stage (TP x DP x CP): global counts, expert bias
    dispatcher: str = "allgather"

    @classmethod
    def from_mesh(cls, mesh, dispatcher: str) -> "ExpertGroups":
        return cls(mesh.group("ep"), mesh.group("etp"), mesh.group("tp_ep"), mesh.group("tp_cp"),
                   mesh.group("tp_dp_cp"), dispatcher)


@dataclass
class ExpertInput:
    """What this rank's experts compute: rows grouped by local expert, with their weights."""

    hidden: torch.Tensor              # [N, hidden]
    probs: torch.Tensor               # [N]
    tokens_per_expert: torch.Tensor   # [local experts] int64, on the device
    state: dict = field(default_factory=dict)   # what combine needs to undo dispatch


def build_dispatcher(groups: ExpertGroups | None, num_experts: int) -> "LocalDispatcher":
    if groups is None or groups.tp_ep is None:
        return LocalDispatcher(num_experts)
    if groups.dispatcher == "alltoall" and groups.ep is not None:   # with one EP rank there is nothing to send
        return AllToAllDispatcher(num_experts, groups)
    return AllGatherDispatcher(num_experts, groups)


class LocalDispatcher:
    """All experts on this rank: pairs sorted by expert, outputs summed back per token."""

    def __init__(self, num_experts: int, first_expert: int = 0):
        self.num_experts, self.first_expert = num_experts, first_expert   # the experts held here

    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertInput:
        return self._permute(x, routing.token_index, routing.expert_index - self.first_expert, routing.probs,
                             per_token=routing.per_token)

    def combine(self, y: torch.Tensor, dispatched: ExpertInput) -> torch.Tensor:
        return self._unpermute(y, dispatched)

    def _permute(self, x, token_index, local_expert, probs, *, per_token) -> ExpertInput:
        # Radix sort makes a pass per key byte: one byte holds up to 256 experts (int64 keys took 8 passes).
        keys = local_expert.to(torch.uint8 if self.num_experts <= 256 else torch.int32)
        order = torch.argsort(keys, stable=True)
        rows = token_index[order]
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, local_expert, torch.ones_like(local_expert))
        state = {"order": order, "rows": rows, "num_tokens": x.shape[0], "per_token": per_token}
        if per_token is None:
            return ExpertInput(x[rows], probs[order], counts, state)
        state["inverse"] = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        return ExpertInput(_CopyToPairs.apply(x, rows, state["inverse"], per_token), probs[order], counts, state)

    @staticmethod
    def _unpermute(y: torch.Tensor, dispatched: ExpertInput) -> torch.Tensor:
        """Sum each token's expert outputs (scatter-added, or with exactly k pairs per token
        brought back to token order and summed k at a time)."""
        state = dispatched.state
        if state["per_token"] is not None:
            return _SumPairs.apply(y, state["order"], state["inverse"], state["per_token"])
        out = y.new_zeros(state["num_tokens"], y.shape[-1])
        return out.index_add(0, state["rows"], y)


class AllGatherDispatcher(LocalDispatcher):
    """Every rank of ETP x EP sees every token of the group and keeps the pairs of its experts."""

    def __init__(self, num_experts: int, groups: ExpertGroups):
        ep_rank, ep_size = rank_and_size(groups.ep)
        super().__init__(num_experts // ep_size, ep_rank * (num_experts // ep_size))
        self.group = groups.tp_ep

    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertInput:
        x_all, token_index, expert_index, probs = _gather_pairs(x, routing, self.group)
        local = (expert_index >= self.first_expert) & (expert_index < self.first_expert + self.num_experts)
        keep = local.nonzero().squeeze(1)   # how many pairs are this rank's is known only on the device
        return self._permute(x_all, token_index[keep], expert_index[keep] - self.first_expert, probs[keep],
                             per_token=None)

    def combine(self, y: torch.Tensor, dispatched: ExpertInput) -> torch.Tensor:
        return reduce_scatter_tokens(self._unpermute(y, dispatched), self.group)


class AllToAllDispatcher(LocalDispatcher):
    """Rows travel to the EP rank of their expert and back (after an all-gather over ETP)."""

    def __init__(self, num_experts: int, groups: ExpertGroups):
        self.ep_rank, self.ep_size = rank_and_size(groups.ep)
        super().__init__(num_experts // self.ep_size, self.ep_rank * (num_experts // self.ep_size))
        self.total_experts, self.ep, self.etp = num_experts, groups.ep, groups.etp

    def dispatch(self, x: torch.Tensor, routing: Routing) -> ExpertInput:
        if self.etp is not None:   # every ETP rank computes its piece of every row of the group
            x, token_index, expert_index, probs = _gather_pairs(x, routing, self.etp)
            per_token = None
        else:
            token_index, expert_index, probs, per_token = (routing.token_index, routing.expert_index,
                                                           routing.probs, routing.per_token)
        # Sort every pair by global expert: rows for each EP rank are then contiguous.
        sent = LocalDispatcher(self.total_experts)._permute(x, token_index, expert_index, probs, per_token=per_token)
        counts = sent.tokens_per_expert.view(self.ep_size, self.num_experts)   # [to rank, its expert]
        received_counts = _all_gather_rows(sent.tokens_per_expert, self.ep).view(
            self.ep_size, self.ep_size, self.num_experts)[:, self.ep_rank]      # [from rank, my expert]
        # The one host sync: all_to_all_single takes its row counts as lists.
        send_splits, receive_splits = torch.stack([counts.sum(dim=1), received_counts.sum(dim=1)]).tolist()
        hidden = _AllToAll.apply(sent.hidden, self.ep, receive_splits, send_splits)
        probs = _AllToAll.apply(sent.probs, self.ep, receive_splits, send_splits)
        # Received rows are grouped by source rank, then expert; the experts want them by expert.
        by_expert = _chunk_transpose(received_counts, sum(receive_splits))
        state = {"sent": sent, "by_expert": by_expert, "splits": (receive_splits, send_splits)}
        return ExpertInput(hidden[by_expert], probs[by_expert], received_counts.sum(dim=0), state)

    def combine(self, y: torch.Tensor, dispatched: ExpertInput) -> torch.Tensor:
        state = dispatched.state
        by_source = torch.empty_like(y).index_copy_(0, state["by_expert"], y)   # inverse of the transpose
        receive_splits, send_splits = state["splits"]
        returned = _AllToAll.apply(by_source, self.ep, send_splits, receive_splits)
        out = self._unpermute(returned, state["sent"])
        return reduce_scatter_tokens(out, self.etp) if self.etp is not None else out


# -- dropless permutation as gathers ---------------------------------------------------------
# With every token in exactly k pairs, both directions of the permutation are gathers: the
# backward of copying tokens to pairs is summing pairs per token, and the other way round.
# Autograd's own backward of an index would be a scatter-add (atomics, not deterministic).

class _CopyToPairs(torch.autograd.Function):
    """x [T, h] -> rows [T k, h] in expert order (pair `inverse[t k + j]` is token t's j-th)."""

    @staticmethod
    def forward(ctx, x, rows, inverse, per_token):
        ctx.save_for_backward(inverse)
        ctx.per_token = per_token
        return x[rows]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return sum_pairs(grad, inverse.view(-1, ctx.per_token)), None, None, None


class _SumPairs(torch.autograd.Function):
    """rows [T k, h] in expert order -> each token's sum of its k rows [T, h]."""

    @staticmethod
    def forward(ctx, y, order, inverse, per_token):
        ctx.save_for_backward(order)
        ctx.per_token = per_token
        return sum_pairs_in_torch(y, inverse.view(-1, per_token))   # torch ops: fused with the residual add

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        pairs = grad.unsqueeze(1).expand(-1, ctx.per_token, -1).reshape(-1, grad.shape[-1])
        return pairs[order], None, None, None


# -- collectives and index arithmetic ---------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """all_to_all_single with per-rank row counts; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), ctx.group, input_splits, output_splits), None, None, None


def _all_gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `tensor` (same shape everywhere) stacked along dim 0; no gradient."""
    out = tensor.new_empty((rank_and_size(group)[1] * tensor.shape[0], *tensor.shape[1:]))
    all_gather_flat(out, tensor.contiguous(), group=group)
    return out


def _gather_pairs(x: torch.Tensor, routing: Routing, group):
    """Tokens [group x T, hidden] and pairs of the whole group, token ids made group-wide.
    With pairs of different counts per rank (capacity drops), shorter lists are padded with
    pairs to expert -1, which no rank holds."""
    rank, size = rank_and_size(group)
    token_index, expert_index, probs = routing.token_index, routing.expert_index, routing.probs
    if not routing.same_size:
        longest = int(_all_gather_rows(torch.tensor([token_index.numel()], device=x.device), group).max())
        pad = longest - token_index.numel()
        token_index, expert_index = (torch.cat([t, t.new_full((pad,), fill)]) for t, fill in
                                     ((token_index, 0), (expert_index, -1)))
        probs = torch.cat([probs, probs.new_zeros(pad)])
    offsets = torch.arange(size, device=x.device).repeat_interleave(token_index.numel()) * routing.num_tokens
    return (all_gather_tokens(x, group), _all_gather_rows(token_index, group) + offsets,
            _all_gather_rows(expert_index, group), all_gather_tokens(probs, group))


def _chunk_transpose(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that reorder `total` rows in chunks laid out [rank][expert] (sizes `counts`
    [ranks, experts]) into [expert][rank] order."""
    sizes = counts.flatten()
    starts = torch.cumsum(sizes, 0) - sizes                     # where each chunk begins, rank-major
    sizes_t, starts_t = counts.t().flatten(), starts.view_as(counts).t().flatten()
    first_row = torch.cumsum(sizes_t, 0) - sizes_t              # where it goes, expert-major
    within = torch.arange(total, device=counts.device) - torch.repeat_interleave(first_row, sizes_t, output_size=total)
    return torch.repeat_interleave(starts_t, sizes_t, output_size=total) + within

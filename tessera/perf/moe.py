"""Step time of a MoE layer's routed half: the router, the experts' grouped GEMMs, the
permutations around them, and token dispatch between GPUs (tessera.perf.simulator times the
rest of the layer: attention, norms, the shared expert as a dense MLP).

Per GPU and micro-batch, with T = this GPU's tokens (its sequence-parallel shard), k the
experts per token, E experts of which E / EP live here, and routing assumed balanced
(the load-balancing loss aims at it; a dropless router's early imbalance, which makes
the busiest GPU the slowest, is not modelled):

- rows computed here: ETP x T x k (each expert-TP rank computes its slice of every row of
  its ETP group), so ETP x T x k x EP / E per local expert;
- experts: one grouped GEMM for fc1 and one for fc2 (--moe-grouped-gemm; else one GEMM
  per expert), every group that many rows, on the GEMM curve (tessera.perf.kernels) at
  moe_ffn / ETP width, in the three pass shapes; with --fp8-experts, in FP8 layers, grouped
  FP8 GEMMs with their casts and row padding (tessera.perf.fp8);
- router: the T x h x E GEMM (in fp32 at the fp32 peak with --moe-router-dtype fp32) and
  its softmax, top-k and load-balancing loss over T x E scores (HBM bytes, an estimate);
- permutation: each sort of the rows reads and writes them, the combine sums k rows
  per token (HBM bytes; that the kernels copy no more than this is an estimate); the
  activation function on the rows;
- dispatch, not overlapped with compute (neither Megatron without
  --overlap-moe-expert-parallel-comm nor tessera overlaps it):
    allgather  all-gather the EP x ETP group's tokens, reduce-scatter the outputs back;
    alltoall   all-gather over ETP (if > 1), all-to-all the rows and their weights over EP,
               and back; the counts are all-gathered first;
  backward runs the conjugate collectives with the same bytes. The group runs over NVLink
  when its ranks share a node, else over the network (tessera.perf.cluster);
- tessera waits for the host to read row counts (`host_sync`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.perf.fp8 import fp8_expert_gemm
from tessera.perf.layout import Layout

if TYPE_CHECKING:
    from tessera.perf.simulator import Phase, StepModel

# HBM bytes per router score (fp32), forward and backward: logits, softmax over the
# experts, top-k and the load-balancing loss's scores, each written once and read once or
# twice (an estimate; the ops are small and not fused).
ROUTER_BYTES_PER_SCORE = (24.0, 24.0)
# Bytes that travel with each (token, expert) pair besides the hidden state: the expert
# and token indices (int64) and the routing weight (fp32).
PAIR_BYTES = 20
# tessera reads row counts on the host once per MoE layer forward in its dispatchers (the
# all-to-all's splits, the allgather path's nonzero) and again in the loop over experts
# without --moe-grouped-gemm: the GPU idles until the next kernels are launched (an
# estimate of launch latency plus Python; not measured).
HOST_SYNC_S = 30e-6


def add_routed_experts(steps: "StepModel", layout: Layout, tokens: float, fwd: "Phase", bwd: "Phase",
                       fp8: bool = False) -> None:
    """Add the router, experts, permutations and dispatch of one MoE layer for this GPU's `tokens`
    (the experts' GEMMs in FP8 if `fp8`)."""
    model, etp = steps.model, layout.expert_tp
    h, f, k, experts = model.hidden_size, model.moe_ffn_hidden_size, model.moe_router_topk, model.num_experts
    local = experts // layout.ep
    rows = etp * tokens * k
    per_expert = max(1.0, rows / local)
    gated = 2 if model.gated_linear_unit else 1
    if fp8:   # FP8 experts are one grouped GEMM each, --moe-grouped-gemm or not (tessera.models.moe)
        groups = local
        fc1 = fp8_expert_gemm(steps, layout, per_expert, gated * f / etp, h, groups, fwd, bwd)
        fc2 = fp8_expert_gemm(steps, layout, per_expert, h, f / etp, groups, fwd, bwd)
    else:
        groups = local if model.moe_grouped_gemm else 1   # one grouped GEMM, or a loop over the experts
        fc1 = steps.gemm(per_expert, gated * f / etp, h, groups=groups)
        fc2 = steps.gemm(per_expert, h, f / etp, groups=groups)
    fwd.add("expert_gemm", local / groups * (fc1[0] + fc2[0]))
    bwd.add("expert_gemm", local / groups * sum(fc1[1:] + fc2[1:]))

    # --moe-router-dtype fp32 (or fp64) runs the router's GEMM off the tensor cores: the fp32 peak.
    wide = {"fp32": 4, "fp64": 8}.get(model.moe_router_dtype)
    peak = steps.cluster.gpu.peak_tflops["fp32"] * 1e12 if wide else None
    router = steps.gemm(tokens, experts, h, peak=peak, bytes_per_element=wide or 2)
    fwd.add("router", router[0] + tokens * experts * ROUTER_BYTES_PER_SCORE[0] / steps.hbm)
    bwd.add("router", router[1] + router[2] + tokens * experts * ROUTER_BYTES_PER_SCORE[1] / steps.hbm)

    sorts = 2 if layout.dispatches and layout.moe_dispatcher == "alltoall" else 1   # by expert; then by source rank
    permute = (2 * 2 * sorts + 1) * 2 * rows * h   # every sort there and back reads and writes; the k-sum reads
    act_fwd, act_bwd = steps.activation_bytes(f / etp)
    fwd.add("memory_bound", (rows * act_fwd + permute) / steps.hbm)
    bwd.add("memory_bound", (rows * act_bwd + permute) / steps.hbm)

    if layout.dispatches:
        forward, backward = dispatch_seconds(steps, layout, tokens)
        fwd.add("ep_comm", forward)
        bwd.add("ep_comm", backward)
    syncs = layout.dispatches + (not (model.moe_grouped_gemm or fp8))
    if layout.framework == "tessera" and syncs:
        fwd.add("host_sync", syncs * HOST_SYNC_S)


def dispatch_seconds(steps: "StepModel", layout: Layout, tokens: float) -> tuple[float, float]:
    """Seconds of a MoE layer's dispatch and combine collectives, forward and backward."""
    cluster, model = steps.cluster, steps.model
    ep, etp, k = layout.ep, layout.expert_tp, model.moe_router_topk
    token_bytes = 2.0 * model.hidden_size
    if layout.moe_dispatcher == "allgather":
        ranks = ep * etp
        per_node = cluster.ranks_per_node(ranks)
        both = cluster.all_gather(ranks * tokens * (token_bytes + PAIR_BYTES * k), ranks, per_node) + \
            cluster.reduce_scatter(ranks * tokens * token_bytes, ranks, per_node)
        return both, both
    seconds = 0.0
    if etp > 1:
        per_node = cluster.ranks_per_node(etp)
        seconds += cluster.all_gather(etp * tokens * (token_bytes + PAIR_BYTES * k), etp, per_node) + \
            cluster.reduce_scatter(etp * tokens * token_bytes, etp, per_node)
    counts = 0.0
    if ep > 1:
        per_node, rows = cluster.ranks_per_node(ep, etp), etp * tokens * k
        # Rows out and back; their weights (fp32) in a collective of their own.
        seconds += 2 * cluster.all_to_all(rows * token_bytes, ep, per_node) + cluster.all_to_all(rows * 4, ep, per_node)
        counts = cluster.all_gather(ep * model.num_experts * 8, ep, per_node)
    return seconds + counts, seconds

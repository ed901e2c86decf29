"""What offloading saves and costs: the planner's model of --optimizer-cpu-offload and
--fine-grained-activation-offloading (tessera.training.optim.offload,
tessera.models.activation_offload).

Memory. Optimizer offload takes --optimizer-offload-fraction of the distributed optimizer's
state (masters and moments) off the GPU, which keeps IN_FLIGHT chunks of it for the step.
Activation offload takes the chosen modules' saved tensors off the GPU, counted with the terms of
tessera.perf.memory (an uncompiled block: the offload hooks need module boundaries); the GPU
still holds one layer's worth of them (the group being copied back and the one prefetched).

Time. Every offloaded byte crosses the host link (PCIe) twice. Activations go down during the
forward pass and come back during the backward, on copy streams: only what a pass's transfers
take beyond the pass itself shows. The optimizer's state goes up and comes back down during the
step, both directions at once, after the backward (the global norm comes first): all of it shows.
The link's rate is the GPU's datasheet PCIe rate per direction at LINK_EFFICIENCY, an estimate
not yet measured on an H200 (bench/offload.py measures it).
"""

from __future__ import annotations

from tessera.config import ModelConfig
from tessera.perf.layout import Layout

# The share of the PCIe datasheet rate a pinned cudaMemcpyAsync reaches (an estimate).
LINK_EFFICIENCY = 0.8
# tessera.training.optim.offload: elements per chunk and chunks on the GPU at once.
CHUNK_ELEMENTS, IN_FLIGHT = 2**25, 3


def link_bytes_per_s(gpu) -> float:
    return gpu.host_link_gb_per_s * 1e9 * LINK_EFFICIENCY


def offloaded_activation_bytes(model: ModelConfig, layout: Layout, seq_length: int, residual: int,
                               moe: bool = False) -> float:
    """What the --offload-modules of one layer save, for one micro-batch on one GPU (bytes the
    GPU does not keep), by tessera.perf.memory's terms for an uncompiled tessera block whose
    residual stream has `residual` bytes an element."""
    chosen = set(layout.offload_modules)
    if not chosen or layout.recompute == "full":
        return 0.0
    tokens = seq_length / layout.cp * layout.micro_batch_size
    h, t = model.hidden_size, layout.tp
    sp = t if layout.sequence_parallel else 1
    gathered = 1 if not layout.tp_comm_overlap else sp   # tessera saves the GEMM inputs gathered under SP
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    f = (model.moe_shared_expert_intermediate_size or 0) if moe else model.ffn_hidden_size
    gated = 2 if model.gated_linear_unit else 1
    per_token = {
        "attn_norm": residual * h / sp,
        "mlp_norm": residual * h / sp,
        "qkv_linear": 2 * h / gathered,
        "core_attn": (2 * (q + 2 * kv) + 4 * model.num_attention_heads) / t,   # Q, K, V and the log-sum-exp
        "attn_proj": 2 * q / t,
        "mlp": (2 * h / gathered + 2 * gated * f / t) if f and not moe else 0.0,   # fc1's input and output
    }
    saved = tokens * sum(per_token[name] for name in chosen if name in per_token)
    if moe and chosen & {"expert_fc1", "moe_act"}:
        etp, routed = layout.expert_tp, model.moe_ffn_hidden_size
        rows = etp * tokens / sp * model.moe_router_topk
        saved += rows * (2 * h + 2 * gated * routed / etp + 2 * routed / etp)   # fc1's input and output, fc2's input
    return saved


def optimizer_offload_bytes(layout: Layout, state_bytes: float) -> float:
    """Of the optimizer state on a GPU, the bytes --optimizer-offload-fraction keeps on the host."""
    return state_bytes * layout.optimizer_offload_fraction if layout.optimizer_cpu_offload else 0.0


def optimizer_chunk_bytes(layout: Layout) -> float:
    """The offloaded optimizer's chunks on the GPU during the step."""
    if not layout.optimizer_cpu_offload:
        return 0.0
    return IN_FLIGHT * CHUNK_ELEMENTS * (layout.master_bytes + layout.moment_bytes)


def exposed_activation_copies(offloaded: float, forward: float, backward: float, link: float) -> float:
    """Seconds one micro-batch's activation copies add: down beside its forward pass, up beside its
    backward, each showing only where it takes longer than the pass."""
    copy = offloaded / link
    return max(copy - forward, 0.0) + max(copy - backward, 0.0)

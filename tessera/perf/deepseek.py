"""Step time of DeepSeek's blocks beside a layer's usual GEMMs (tessera.perf.simulator times
the rest): multi-latent attention's projections, and the multi-token prediction depths after
the output layer.

Multi-latent attention under Megatron's tensor parallelism (tessera.models.mla): the down
projections are replicated, each rank running them on its own tokens (its sequence shard
under SP, else all of them, redundantly); the up projections are column-parallel and the
output projection row-parallel, so the block's collectives move the latents and the
positional key (or, without q-LoRA, the input of the column-parallel query projection), not
the hidden state, on the way in, and the hidden state on the way out. Memory-bound work:
RoPE on the queries' and the shared key's positional parts, the concatenation of each head's
query and key (read and written, bf16), and the latents' norms.

An MTP depth (tessera.models.mtp) is its 2h -> h projection (column-parallel, its output
gathered), one layer of the last layer's kind, and the output layer and loss again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tessera.perf.layout import Layout

if TYPE_CHECKING:
    from tessera.perf.simulator import Phase, StepModel


def latent_attention(steps: "StepModel", layout: Layout, tokens: float, fwd: "Phase", bwd: "Phase", linear
                     ) -> tuple[list, list, float]:
    """Add the replicated down projections to the phases; return the (column, row) parallel GEMM
    pair (timed by `linear`, the layer's tensor-parallel GEMM: bf16 or FP8), the bytes of its input
    and output collectives, and the memory-bound bytes per token (before the division by TP the
    simulator applies)."""
    model, t = steps.model, layout.tp
    h, n = model.hidden_size, model.num_attention_heads
    qk, pos, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
    q_rank, kv_rank = model.q_lora_rank, model.kv_lora_rank
    shard = tokens / (t if layout.sequence_parallel else 1)
    down = [steps.gemm(shard, kv_rank + pos, h)] + ([steps.gemm(shard, q_rank, h)] if q_rank else [])
    fwd.add("gemm", sum(gemm[0] for gemm in down))
    bwd.add("gemm", sum(gemm[1] + gemm[2] for gemm in down))
    query = linear(tokens, n * (qk + pos) / t, q_rank or h)
    column = tuple(a + b for a, b in zip(query, linear(tokens, n * (qk + v) / t, kv_rank)))
    gathered = tokens * 2 * ((q_rank or h) + kv_rank + pos)
    latent_norms = 10 * ((q_rank or 0) + kv_rank) * shard / tokens * t   # on this rank's tokens, whole
    memory_bound = 4 * (n + 1) * pos + 8 * n * (qk + pos) + latent_norms
    return [(column, linear(tokens, h, n * v / t))], [(gathered, tokens * h * 2)], memory_bound


def add_mtp_depths(steps: "StepModel", layout: Layout, fwd: "Phase", bwd: "Phase") -> None:
    """Add the --mtp-num-layers depths after the output layer whose passes `fwd` and `bwd` hold."""
    model, t = steps.model, layout.tp
    tokens = layout.micro_batch_size * steps.seq / layout.cp
    layer_fwd, layer_bwd = steps.layer(layout, moe=model.moe_layers(with_mtp=True)[-1])
    projection = steps.gemm(tokens, model.hidden_size / t, 2 * model.hidden_size)
    gathered = steps.cluster.all_gather(tokens * model.hidden_size * 2, t, steps.cluster.ranks_per_node(t))
    head_fwd, head_bwd = dict(fwd.times), dict(bwd.times)
    for _ in range(model.mtp_num_layers or 0):
        for phase, layer, head, gemm in ((fwd, layer_fwd, head_fwd, projection[0]),
                                         (bwd, layer_bwd, head_bwd, projection[1] + projection[2])):
            phase.extend(layer)
            for category, seconds in head.items():
                phase.add(category, seconds)
            phase.add("gemm", gemm)
            phase.add("tp_comm", gathered)

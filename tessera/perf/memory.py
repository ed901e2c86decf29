"""Bytes per GPU of a training step: weights, gradients, optimizer state, activations, logits.

Two trainers are modelled (`Layout.framework`), each checked against measured peaks:

- Megatron-Core (the published runs): bf16 weights (2 bytes), fp32 main gradients (4) and
  an fp32 master copy plus Adam's two moments (12): 18 bytes per parameter, of which the
  distributed optimizer shards the 12 over data parallel (x context parallel) and FSDP
  all 18.
- tessera: with the distributed optimizer the same scheme. Without it, fp32 weights that
  are also Adam's masters (4), their bf16 casts kept by autocast from forward to backward
  (2), the two moments (8), and fp32 gradients (4) only where they outlive a backward: a
  data-parallel bucket buffer, several micro-batches, or a pipeline's interleaved
  backwards; one micro-batch on one GPU peaks at the end of forward with none. Measured on
  one and two H200s (docs/scaling.md, "Calibration"): bench/train_mfu.py --memory-trace
  charges every live block at the peak to the line that allocated it. With
  --fp8-param-gather the FP8 linears' weights also keep the E4M3 copy (1) that the
  distributed optimizer gathers into.

Activations follow Korthikanti et al. 2022 ("Reducing activation recomputation"), term by
term, so GQA, SwiGLU, dropout and fused attention change the right terms. Per layer and
micro-batch, with s = sequence (per CP rank), b = micro-batch, t = TP:

  sharded only by sequence parallelism   two norm inputs 4sbh, QKV and fc1 inputs 2sbh each,
                                          two dropout masks sbh each (if hidden dropout > 0)
  sharded by TP                           Q, K, V 2sb(q + 2kv), attention output 2sbq,
                                          fc1 output 2sbf (x2 gated), fc2 input 2sbf,
                                          core attention: 5as^2b unfused (scores, mask, dropout),
                                          or the fused kernel's fp32 log-sum-exp 4sba

For GPT (q = kv = h, f = 4h, dropout, unfused) this is the paper's sbh(34 + 5as/h) at
TP = 1, sbh(10 + 24/t + 5as/(ht)) with TP and sbh(34 + 5as/h)/t with SP. Selective
recompute drops the core-attention term; full recompute keeps only each layer's input.
tessera's layers differ where its saved tensors (counted with saved-tensor hooks,
tests/perf/test_memory.py) do: the residual stream is fp32 when the weights are (norm
inputs 4 bytes); a compiled block saves only the first norm's input but also copies the
fused kernel's output into the projection's input (both saved); RoPE's rotated Q and K are
saved beside the QKV output (which V, a view of it, keeps alive); and under SP the QKV and
fc1 inputs are saved all-gathered, but only their shards with --tp-comm-overlap (whose
backward gathers them again, tessera.parallel.tp_overlap). A layer with FP8 linears (tessera.kernels.fp8) saves their
bf16 inputs too, but a compiled one rebuilds the norms' outputs and fc2's input in backward
(counted with saved-tensor hooks, tests/perf/test_fp8_plan.py): 2sb(2h + f) less per layer
(2sbf under SP, whose gathered inputs stay).

Multi-latent attention replaces the QKV terms by its own (`mla_saved_elements`): the down
projections' input and the latents (sharded only by SP), the up projections' gathered
inputs, and per head the concatenated queries and keys, the keys-and-values projection and
the output (sharded by TP). The MTP depths sit on the last pipeline stage: their layers,
norms and projection inputs, one more set of logits each, and their parameters.

In a MoE layer the dense MLP terms are the shared expert's (if any), and the routed
experts add theirs (`routed_expert_bytes`). Expert weights are sharded over EP x ETP and
replicated over expert data parallelism (EDP = TP x CP x DP / (EP x ETP)), so the
distributed optimizer shards their state over EDP, the dense state over DP x CP.

A hybrid stack (--hybrid-layer-pattern) is priced layer by layer by its symbol: a `*` layer is
the attention terms, a `-` or `E` layer the MLP or MoE terms, each with one norm input and no
second norm to rebuild; a Mamba-2 or Gated DeltaNet layer is priced by tessera.perf.mixers.

The pipeline decides how many micro-batches are alive: under 1F1B the first stage holds
min(p, m) of them; under the interleaved schedule min(m*v, 2(p-1) + (v-1)p + 1) model
chunks (Megatron's warm-up count plus the one in flight), which is the paper's
L x (1 + (p-1)/(pv)) layers' worth. Every pipeline rank is counted with its own layers
(uneven splits move them) and the fullest is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from tessera.config import ModelConfig
from tessera.config.hybrid import ATTENTION, layer_symbols
from tessera.perf.flops import LayerParameters, attention_projections, count_parameters, layer_parameters
from tessera.perf.layout import Layout
from tessera.perf.mixers import MIXERS, mixer_activation_bytes
from tessera.perf.offload import offloaded_activation_bytes, optimizer_chunk_bytes, optimizer_offload_bytes

GIB = 2**30
# What a MoE router and its permutation keep, as counted on tessera's compiled MoE block
# (tests/perf/test_memory.py): two fp32 [tokens, experts] tensors (logits and scores) per
# token and expert; per routed row its fp32 weight and four int64 indices (token, expert,
# sort order and its inverse).
ROUTER_SCORE_BYTES = 8.0
ROW_INDEX_BYTES = 36.0
# Of the device's memory, what the allocator can hand out: the CUDA context, NCCL's own
# buffers and fragmentation take the rest (about 8%).
USABLE_FRACTION = 0.92


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the fullest GPU, by category."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float        # output layer and cross-entropy buffers of one micro-batch (last stage)
    buffers: float       # gathered activations (SP), unsharded layers (FSDP), token dispatch (MoE)
    stage: str           # which pipeline stage this is ("pipeline rank 0 of 4", "the only stage")
    expert_state: float = 0.0   # of weights + gradients + optimizer: the routed experts' part
    host: float = 0.0           # kept in host memory instead (offloaded optimizer state), not in the total

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict:
        """The categories that add up to the total."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("stage", "expert_state", "host")}


def layer_activation_bytes(model: ModelConfig, layout: Layout, seq_length: int, fused_attention: bool = True,
                           moe: bool = False, fp8: bool = False, symbol: str | None = None) -> float:
    """Activations one transformer layer (a MoE layer if `moe`, with FP8 linears if `fp8`; of a hybrid
    stack, only its `symbol`'s part: attention, MLP, MoE or a mixer) saves for backward, for one
    micro-batch on one GPU."""
    residual = residual_bytes(layout)
    if symbol in MIXERS:
        return mixer_activation_bytes(model, layout, seq_length, symbol, residual)
    s, b, h = seq_length / layout.cp, layout.micro_batch_size, model.hidden_size
    attention, mlp = symbol in (None, ATTENTION), symbol != ATTENTION
    # A MoE layer's dense MLP is its shared expert, if it has one; the routed experts come on top.
    f = ((model.moe_shared_expert_intermediate_size or 0) if moe else model.ffn_hidden_size) if mlp else 0
    t = layout.tp
    sp = t if layout.sequence_parallel else 1
    tessera = layout.framework == "tessera"
    if layout.recompute == "full":
        return residual * s * b * h / sp
    # A transformer block has two norms (a compiled one saves only the first's input), a hybrid layer one.
    norms = 1 if symbol is not None or (tessera and layout.compiled) else 2
    norm_inputs = norms * residual * s * b * h
    masks = (2 if symbol is None else 1) * s * b * h if model.hidden_dropout > 0 else 0.0
    # tessera's FP8 linears save their bf16 inputs (tessera.kernels.fp8), and a compiled block then
    # rebuilds fc2's (the activation's output) and the norms' outputs (QKV's and fc1's inputs) in
    # backward rather than keeping them. Under SP those two are all-gathered, which it cannot redo.
    rebuilds = fp8 and tessera and layout.compiled
    rebuilds_norms = rebuilds and not layout.sequence_parallel
    gemm_inputs = 2 * s * b * h if f and not rebuilds_norms else 0.0   # fc1's
    gated = 2 if model.gated_linear_unit else 1
    # tessera's activation enters fc2's GEMM in one autograd function that keeps fc1's output, not the
    # activation (tessera.kernels.activation_linear), where fc2 has no GEMMs of its own (FP8, overlap).
    fused_activation = tessera and not fp8 and not layout.tp_comm_overlap
    tensor_sharded = 2 * s * b * f * gated + (0.0 if rebuilds or fused_activation else 2 * s * b * f)
    if attention:
        attention_terms = _attention_saved_bytes(model, layout, s, b, rebuilds_norms, fused_attention)
        norm_inputs, gemm_inputs, tensor_sharded = (
            total + term for total, term in zip((norm_inputs, gemm_inputs, tensor_sharded), attention_terms))
    # A compiled block keeps the attention projection's output (after its all-reduce or
    # reduce-scatter) to rebuild the second norm's input, the residual, in backward.
    projection_output = (2 * s * b * h if symbol is None and tessera and layout.compiled
                         and layout.recompute != "selective" else 0.0)
    routed = routed_expert_bytes(model, layout, s * b / sp) if moe else 0.0
    if tessera and not layout.tp_comm_overlap:   # the whole GEMM inputs (replicated, or all-gathered under SP)
        return (norm_inputs + masks + projection_output) / sp + gemm_inputs + tensor_sharded / t + routed
    return (norm_inputs + masks + gemm_inputs + projection_output) / sp + tensor_sharded / t + routed


def _attention_saved_bytes(model: ModelConfig, layout: Layout, s: float, b: int, rebuilds_norms: bool,
                           fused_attention: bool) -> tuple[float, float, float]:
    """Attention's part of a layer's saved bytes for b sequences of s tokens: (sharded only by SP,
    GEMM inputs, sharded by TP)."""
    tokens, h, a = s * b, model.hidden_size, model.num_attention_heads
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    replicated = gemm_inputs = tensor_sharded = 0.0
    if model.multi_latent_attention:
        replicated, gathered, sharded = mla_saved_elements(model, layout)
        replicated, gemm_inputs, tensor_sharded = replicated * tokens, gathered * tokens, sharded * tokens
        q = model.num_attention_heads * model.v_head_dim   # the attention output's width
    else:
        gemm_inputs = 0.0 if rebuilds_norms else 2 * tokens * h   # QKV's
        # Q, K and V for attention's backward, as wide as the QKV output (tessera's rotated Q and K are
        # new tensors, and V is then copied out so as not to keep all of it), and attention's output.
        tensor_sharded = 2 * tokens * (q + 2 * kv) + 2 * tokens * q
    if layout.recompute != "selective":
        if fused_attention:
            tensor_sharded += 4 * tokens * a
        else:
            per_score = 5 if model.attention_dropout > 0 else 2   # scores, and mask + dropout output
            tensor_sharded += per_score * a * s * s * b
    return replicated, gemm_inputs, tensor_sharded


def mla_saved_elements(model: ModelConfig, layout: Layout) -> tuple[float, float, float]:
    """Bytes per token that multi-latent attention saves for backward, besides the core attention's
    own: (sharded only by sequence parallelism, GEMM inputs the up projections gather, sharded by TP).

    Each rank runs the replicated down projections on its tokens (their input, once per
    projection in tessera's fp32-weight runs, where autocast casts it for each; with q-LoRA
    the query latent before and after its norm; the key/value latent with the positional key,
    and after the norm); the up projections keep their gathered inputs (tessera; Megatron
    keeps its shard and gathers again); without q-LoRA the query projection is column-parallel
    and keeps its own gathered copy of the input. Per head, the attention's query and key
    (d_qk + d_pe wide, built by concatenation), the values (copied out of the up projection's
    output, so that they do not keep its keys alive) and the attention output.
    Measured with saved-tensor hooks on a compiled block (tests/perf/test_deepseek_plan.py).
    """
    h, n = model.hidden_size, model.num_attention_heads
    qk, pos, v = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
    q_rank, kv_rank = model.q_lora_rank or 0, model.kv_lora_rank
    tessera = layout.framework == "tessera"
    casts = tessera and residual_bytes(layout) == 4   # fp32 weights: each linear casts its input
    replicated = 2 * h * (2 if casts and q_rank else 1) + 2 * q_rank + 2 * (kv_rank + pos)
    gathered = 2 * q_rank + 2 * kv_rank
    if not q_rank and tessera and (casts or layout.sequence_parallel):
        gathered += 2 * h   # q_proj's own copy of the input kv_down reads: its cast, or gathered under SP
    queries_keys, values, output = 2 * 2 * n * (qk + pos), 2 * n * v, 2 * n * v
    return replicated, gathered, queries_keys + values + output


def mtp_depth_activation_bytes(model: ModelConfig, layout: Layout, seq_length: int) -> float:
    """What one MTP depth saves for backward, for one micro-batch on one GPU: its layer's, the
    inputs of its three norms, and its projection's input (the two normed halves, gathered by
    tessera's column-parallel projection under SP)."""
    s, b, h = seq_length / layout.cp, layout.micro_batch_size, model.hidden_size
    sp = layout.tp if layout.sequence_parallel else 1
    layer = layer_activation_bytes(model, layout, seq_length, moe=model.moe_layers(with_mtp=True)[-1])
    if layout.recompute == "full":
        return layer
    projection = 2 * 2 * s * b * h / (1 if layout.framework == "tessera" else sp)
    return layer + 3 * residual_bytes(layout) * s * b * h / sp + projection


def routed_expert_bytes(model: ModelConfig, layout: Layout, tokens: float) -> float:
    """What a MoE layer's router and routed experts save for backward, for this GPU's `tokens`
    (its sequence-parallel shard).

    Each expert-TP rank computes its slice of every row of its ETP group, so the rows are
    ETP x tokens x k under balanced routing (the aux loss aims at it; a dropless router's
    imbalance at the start of training is not modelled). Each row keeps its copy of the
    token's hidden state (fc1's input), fc1's output and fc2's input at moe_ffn / ETP width
    (bf16, as a compiled or fused expert MLP saves them; tessera's eager one keeps fp32
    intermediates too), and its weight and indices. The router keeps its bf16 input (an
    fp32 router casts it again in backward) and its scores.
    """
    h, f, etp = model.hidden_size, model.moe_ffn_hidden_size, layout.expert_tp
    gated = 2 if model.gated_linear_unit else 1
    rows = etp * tokens * model.moe_router_topk
    router = 2 * tokens * h + ROUTER_SCORE_BYTES * tokens * model.num_experts
    return router + rows * (2 * h + 2 * gated * f / etp + 2 * f / etp + ROW_INDEX_BYTES)


def dispatch_buffer_bytes(model: ModelConfig, layout: Layout, seq_length: int) -> float:
    """The largest transient tensor of token dispatch (an estimate): the all-gathered tokens of
    the EP x ETP group (allgather), or the send and receive buffers of the rows (alltoall)."""
    if not layout.dispatches:
        return 0.0
    tokens = seq_length / layout.cp * layout.micro_batch_size / (layout.tp if layout.sequence_parallel else 1)
    if layout.moe_dispatcher == "allgather":
        return 2.0 * layout.ep * layout.expert_tp * tokens * model.hidden_size
    return 2 * 2.0 * layout.expert_tp * tokens * model.moe_router_topk * model.hidden_size


def residual_bytes(layout: Layout) -> int:
    """Bytes per element of the residual stream and the weights: bf16, except in tessera's fp32-weight runs."""
    return 4 if layout.framework == "tessera" and not (layout.distributed_optimizer or layout.fsdp) else 2


def chunks_in_flight(layout: Layout, num_micro_batches: int, stage: int) -> int:
    """Model chunks (micro-batch x virtual stage) whose activations a pipeline rank holds at peak."""
    p, v = layout.pp, layout.virtual_stages
    if v == 1:
        return min(num_micro_batches, p - stage)
    warmup = 2 * (p - stage - 1) + (v - 1) * p
    return min(num_micro_batches * v, warmup + 1)


class StageParameters(NamedTuple):
    """Parameters held by one GPU of a pipeline rank."""

    dense: float     # sharded by TP, replicated over DP x CP
    experts: float   # routed experts: sharded by EP x ETP, replicated over EDP
    fp8_linears: float = 0.0   # of `dense`, the weights of the linears that run in FP8

    @property
    def total(self) -> float:
        return self.dense + self.experts


class ModelLayers(NamedTuple):
    """What the memory model reads of each layer of a model, worked out once (a search asks often)."""

    moe: list[bool]                    # ModelConfig.moe_layers
    parameters: list[LayerParameters]  # flops.layer_parameters
    mtp: LayerParameters               # mtp_parameters
    symbols: list[str | None]          # hybrid layer symbols (tessera.config.hybrid); None: transformer blocks

    @classmethod
    def of(cls, model: ModelConfig) -> "ModelLayers":
        pattern = model.hybrid_layer_pattern
        symbols = layer_symbols(pattern) if pattern is not None else [None] * model.num_layers
        return cls(model.moe_layers(), layer_parameters(model), mtp_parameters(model), symbols)


def stage_parameters(model: ModelConfig, layout: Layout, vocab_size: int, pp_rank: int,
                     layers_of: ModelLayers | None = None) -> StageParameters:
    """Parameters held by one GPU of pipeline rank `pp_rank` (`layers_of` the model's, if at hand)."""
    h = model.hidden_size
    layers_of = layers_of or ModelLayers.of(model)
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    every_layer = layers_of.parameters
    indices = layout.rank_layers(model.num_layers)[pp_rank]
    layers = [every_layer[i] for i in indices]
    params = sum(layer.dense for layer in layers) / layout.tp
    word_embedding = vocab_size * h / layout.tp
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    if first:
        params += word_embedding + positions
    experts = sum(layer.experts for layer in layers)
    fp8, moe = layout.fp8_layers(model.num_layers), layers_of.moe
    fp8_linears = sum(fp8_linear_weights(model, moe[i]) for i in indices if fp8[i]) / layout.tp
    if last:
        params += h * (2 if model.normalization == "LayerNorm" else 1)
        if not model.tie_embeddings:
            params += word_embedding   # the output layer
        if not first and model.last_stage_embedding:
            params += word_embedding   # this stage's copy of the word embedding (tied output layer, MTP input)
        params, experts = params + layers_of.mtp.dense / layout.tp, experts + layers_of.mtp.experts
    return StageParameters(params, experts / (layout.ep * layout.expert_tp), fp8_linears)


def fp8_linear_weights(model: ModelConfig, moe: bool = False) -> int:
    """Weight elements of a layer's linears that run in FP8 (tessera.perf.fp8), before TP shards
    them: its tensor-parallel ones, attention's projections (not MLA's replicated down projections
    to the latents) and the dense MLP or shared expert. Their biases stay bf16."""
    h = model.hidden_size
    projections = attention_projections(model)
    if model.multi_latent_attention:
        latents = [model.kv_lora_rank + model.qk_pos_emb_head_dim] + ([model.q_lora_rank] if model.q_lora_rank else [])
        for width in latents:
            projections.remove((h, width))
    ffn = (model.moe_shared_expert_intermediate_size or 0) if moe else model.ffn_hidden_size
    gated = 2 if model.gated_linear_unit else 1
    return sum(i * o for i, o in projections) + (gated + 1) * h * ffn


def mtp_parameters(model: ModelConfig) -> LayerParameters:
    """The multi-token prediction depths' parameters (on the last stage): each a layer of the last
    layer's kind (its routed experts sharded as the others), two norms, a projection, a norm."""
    depths = model.mtp_num_layers or 0
    experts = depths * layer_parameters(model)[-1].experts
    return LayerParameters(count_parameters(model).mtp - experts, experts)


def estimate_memory(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int,
                    vocab_size: int | None = None, layers_of: ModelLayers | None = None,
                    ranks: range | None = None) -> MemoryBreakdown:
    """Peak bytes on the fullest GPU of the layout (the largest of its pipeline stages; of `ranks`
    of them if given: the first alone, which holds the most micro-batches, is a quick lower bound)."""
    vocab = vocab_size if vocab_size is not None else model.padded_vocab_size(layout.tp)
    layers_of = layers_of or ModelLayers.of(model)
    return max((_stage_memory(model, layout, global_batch_size, seq_length, vocab, rank, layers_of)
                for rank in ranks or range(layout.pp)), key=lambda m: m.total)


def _stage_memory(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int,
                  vocab: int, pp_rank: int, layers_of: ModelLayers) -> MemoryBreakdown:
    params = stage_parameters(model, layout, vocab, pp_rank, layers_of)
    num_micro_batches = layout.num_micro_batches(global_batch_size)
    # Dense state is sharded over DP x CP, the experts' over their own replicas (EDP).
    dense_bytes = _state_bytes_per_parameter(layout, num_micro_batches, layout.dp * layout.cp)
    expert_bytes = _state_bytes_per_parameter(layout, num_micro_batches, layout.edp)
    weights, gradients, optimizer = (d * params.dense + e * params.experts for d, e in zip(dense_bytes, expert_bytes))
    if layout.fp8_param_gather:   # the E4M3 copy gathered into, beside the bf16 weights (FSDP2: its shard)
        weights += params.fp8_linears / (layout.dp * layout.cp) if layout.fsdp else params.fp8_linears
    moe = layers_of.moe
    layers = layout.rank_layers(model.num_layers)[pp_rank]
    buffers = 0.0
    if layout.fsdp:
        # The largest layer being computed and the one being prefetched, unsharded (bf16 weights, fp32 grads).
        every_layer = layers_of.parameters
        largest = max(every_layer[i].dense / layout.tp + every_layer[i].experts / (layout.ep * layout.expert_tp)
                      for i in layers)
        buffers += 2 * 6.0 * largest

    s, b, h = seq_length / layout.cp, layout.micro_batch_size, model.hidden_size
    # (MoE, FP8, hybrid symbol) of each layer
    kinds = list(zip(moe, layout.fp8_layers(model.num_layers), layers_of.symbols))
    per_kind = {kind: layer_activation_bytes(model, layout, seq_length, moe=kind[0], fp8=kind[1], symbol=kind[2])
                for kind in set(kinds)}
    chunks = chunks_in_flight(layout, num_micro_batches, pp_rank)
    # Chunks in flight, each a 1/v share of the rank's layers (alike when MoE layers are spread evenly).
    activations = chunks * sum(per_kind[kinds[i]] for i in layers) / layout.virtual_stages
    if layout.offload_modules:   # gone to the host but for one layer's, in flight (tessera.perf.offload)
        offloaded = {kind: offloaded_activation_bytes(model, layout, seq_length, residual_bytes(layout), kind[0])
                     for kind in set(kinds)}
        activations -= chunks * sum(offloaded[kinds[i]] for i in layers) / layout.virtual_stages
        activations += max(offloaded[kinds[i]] for i in layers)
    if layout.recompute == "full":
        # Backward recomputes one layer at a time: its full activations exist briefly.
        activations += max(layer_activation_bytes(model, replace(layout, recompute="none"), seq_length,
                                                  moe=kinds[i][0], fp8=kinds[i][1], symbol=kinds[i][2])
                           for i in layers)
    last = pp_rank == layout.pp - 1
    depths = (model.mtp_num_layers or 0) if last else 0
    if depths:
        activations += chunks / layout.virtual_stages * depths * mtp_depth_activation_bytes(model, layout, seq_length)
    # bf16 logits + the fp32 softmax (or its gradient), the model's and each MTP depth's; tessera's
    # compiled loss at TP = 1 fuses the softmax into the loss kernel and keeps only the bf16 logits.
    per_logit = 2.0 if layout.framework == "tessera" and layout.compiled and layout.tp == 1 else 6.0
    logits = per_logit * s * b * vocab / layout.tp * (1 + depths) if last else 0.0
    if layout.sequence_parallel and layout.framework == "megatron":
        buffers += 2.0 * s * b * h  # the all-gathered input of the GEMM being computed (tessera saves it)
    if any(moe[i] for i in layers):
        buffers += dispatch_buffer_bytes(model, layout, seq_length)
    stage = "the only stage" if layout.pp == 1 else f"pipeline rank {pp_rank} of {layout.pp}"
    host = optimizer_offload_bytes(layout, optimizer)
    buffers += optimizer_chunk_bytes(layout)
    return MemoryBreakdown(weights, gradients, optimizer - host, activations, logits, buffers, stage,
                           sum(expert_bytes) * params.experts, host)


def _state_bytes_per_parameter(layout: Layout, num_micro_batches: int, shards: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter at the step's peak, for
    parameters with `shards` data-parallel replicas."""
    if layout.fsdp:
        return 2.0 / shards, 4.0 / shards, 12.0 / shards
    if layout.distributed_optimizer:   # masters and moments (with the precision-aware flags: remainders, bf16)
        # tessera with nothing to reduce or accumulate keeps no gradient buffer: autograd's bf16
        # gradients appear in backward as the activations go (tessera.training.optimizer).
        buffered = layout.framework != "tessera" or shards > 1 or num_micro_batches > 1
        return 2.0, 4.0 if buffered else 0.0, (layout.master_bytes + layout.moment_bytes) / shards
    if layout.framework == "megatron":
        return 2.0, 4.0, 12.0
    # tessera, fp32 weights: + their autocast bf16 casts; gradients exist at the peak only
    # if something keeps them across a backward.
    kept = shards > 1 or num_micro_batches > 1 or layout.pp > 1
    return 4.0 + 2.0, 4.0 if kept else 0.0, 8.0


def usable_bytes(memory_gib: float) -> float:
    return memory_gib * GIB * USABLE_FRACTION

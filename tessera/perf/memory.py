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
  charges every live block at the peak to the line that allocated it.

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
fc1 inputs are saved all-gathered.

The pipeline decides how many micro-batches are alive: under 1F1B the first stage holds
min(p, m) of them; under the interleaved schedule min(m*v, 2(p-1) + (v-1)p + 1) model
chunks (Megatron's warm-up count plus the one in flight), which is the paper's
L x (1 + (p-1)/(pv)) layers' worth. Every pipeline rank is counted with its own layers
(uneven splits move them) and the fullest is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tessera.config import ModelConfig
from tessera.perf.flops import count_parameters
from tessera.perf.layout import Layout

GIB = 2**30
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
    buffers: float       # gathered activations (SP), unsharded layers (FSDP)
    stage: str           # which pipeline stage this is ("pipeline rank 0 of 4", "the only stage")

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "stage")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stage"}


def layer_activation_bytes(model: ModelConfig, layout: Layout, seq_length: int,
                           fused_attention: bool = True) -> float:
    """Activations one transformer layer saves for backward, for one micro-batch on one GPU."""
    s, b = seq_length / layout.cp, layout.micro_batch_size
    h, f, a = model.hidden_size, model.ffn_hidden_size, model.num_attention_heads
    q = model.num_attention_heads * model.kv_channels
    kv = model.num_query_groups * model.kv_channels
    t = layout.tp
    sp = t if layout.sequence_parallel else 1
    tessera = layout.framework == "tessera"
    residual = _residual_bytes(layout)
    if layout.recompute == "full":
        return residual * s * b * h / sp
    norm_inputs = (1 if tessera and layout.compiled else 2) * residual * s * b * h
    masks = 2 * s * b * h if model.hidden_dropout > 0 else 0.0
    gemm_inputs = 2 * s * b * h + 2 * s * b * h   # QKV and fc1
    gated = 2 if model.swiglu else 1
    tensor_sharded = 2 * s * b * (q + 2 * kv) + 2 * s * b * q + 2 * s * b * f * gated + 2 * s * b * f
    if tessera and model.position_embedding_type == "rope":
        tensor_sharded += 2 * s * b * (q + kv)   # rotated Q and K, beside the QKV output that V is a view of
    if layout.recompute != "selective":
        if fused_attention:
            # A compiled block also saves the projection's input, a copy of the kernel's output.
            tensor_sharded += 4 * s * b * a + (2 * s * b * q if tessera and layout.compiled else 0.0)
        else:
            per_score = 5 if model.attention_dropout > 0 else 2   # scores, and mask + dropout output
            tensor_sharded += per_score * a * s * s * b
    if tessera:   # the all-gathered GEMM inputs are what autograd keeps
        return (norm_inputs + masks) / sp + (gemm_inputs * sp + tensor_sharded) / t
    return (norm_inputs + masks + gemm_inputs) / sp + tensor_sharded / t


def _residual_bytes(layout: Layout) -> int:
    """Bytes per element of the residual stream: bf16, except in tessera's fp32-weight runs."""
    return 4 if layout.framework == "tessera" and not (layout.distributed_optimizer or layout.fsdp) else 2


def chunks_in_flight(layout: Layout, num_micro_batches: int, stage: int) -> int:
    """Model chunks (micro-batch x virtual stage) whose activations a pipeline rank holds at peak."""
    p, v = layout.pp, layout.virtual_stages
    if v == 1:
        return min(num_micro_batches, p - stage)
    warmup = 2 * (p - stage - 1) + (v - 1) * p
    return min(num_micro_batches * v, warmup + 1)


def _params_per_layer(model: ModelConfig) -> float:
    params = count_parameters(model, vocab_size=model.hidden_size)  # vocabulary is counted apart
    norm = model.hidden_size * (2 if model.normalization == "LayerNorm" else 1)
    return (params.non_embedding - norm) / model.num_layers


def stage_parameters(model: ModelConfig, layout: Layout, vocab_size: int, pp_rank: int) -> float:
    """Parameters held by one GPU of pipeline rank `pp_rank`."""
    h = model.hidden_size
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    params = layout.layers_per_rank(model.num_layers)[pp_rank] * _params_per_layer(model) / layout.tp
    word_embedding = vocab_size * h / layout.tp
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    if first:
        params += word_embedding + positions
    if last:
        params += h * (2 if model.normalization == "LayerNorm" else 1)
        # An untied output layer, or the copy of the tied embedding a separate last stage keeps.
        if not model.tie_embeddings or not first:
            params += word_embedding
    return params


def estimate_memory(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int,
                    vocab_size: int | None = None) -> MemoryBreakdown:
    """Peak bytes on the fullest GPU of the layout (the largest of its pipeline stages)."""
    vocab = vocab_size if vocab_size is not None else model.padded_vocab_size(layout.tp)
    return max((_stage_memory(model, layout, global_batch_size, seq_length, vocab, rank) for rank in range(layout.pp)),
               key=lambda m: m.total)


def _stage_memory(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int,
                  vocab: int, pp_rank: int) -> MemoryBreakdown:
    params = stage_parameters(model, layout, vocab, pp_rank)
    num_micro_batches = layout.num_micro_batches(global_batch_size)
    weights, gradients, optimizer = _state_bytes_per_parameter(layout, num_micro_batches)
    weights, gradients, optimizer = weights * params, gradients * params, optimizer * params
    buffers = 0.0
    if layout.fsdp:
        # The layer being computed and the one being prefetched, unsharded (bf16 weights, fp32 grads).
        buffers += 2 * 6.0 * _params_per_layer(model) / layout.tp

    s, b, h = seq_length / layout.cp, layout.micro_batch_size, model.hidden_size
    per_layer = layer_activation_bytes(model, layout, seq_length)
    layers_per_chunk = layout.layers_per_rank(model.num_layers)[pp_rank] / layout.virtual_stages
    chunks = chunks_in_flight(layout, num_micro_batches, pp_rank)
    activations = chunks * layers_per_chunk * per_layer
    if layout.recompute == "full":
        # Backward recomputes one layer at a time: its full activations exist briefly.
        activations += layer_activation_bytes(model, replace(layout, recompute="none"), seq_length)
    # bf16 logits + the fp32 softmax (or its gradient); tessera's compiled loss at TP = 1
    # fuses the softmax into the loss kernel and keeps only the bf16 logits.
    per_logit = 2.0 if layout.framework == "tessera" and layout.compiled and layout.tp == 1 else 6.0
    logits = per_logit * s * b * vocab / layout.tp if pp_rank == layout.pp - 1 else 0.0
    if layout.sequence_parallel and layout.framework == "megatron":
        buffers += 2.0 * s * b * h  # the all-gathered input of the GEMM being computed (tessera saves it)
    stage = "the only stage" if layout.pp == 1 else f"pipeline rank {pp_rank} of {layout.pp}"
    return MemoryBreakdown(weights, gradients, optimizer, activations, logits, buffers, stage)


def _state_bytes_per_parameter(layout: Layout, num_micro_batches: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter at the step's peak."""
    shards = layout.dp * layout.cp
    if layout.fsdp:
        return 2.0 / shards, 4.0 / shards, 12.0 / shards
    if layout.distributed_optimizer:
        return 2.0, 4.0, 12.0 / shards
    if layout.framework == "megatron":
        return 2.0, 4.0, 12.0
    # tessera, fp32 weights: + their autocast bf16 casts; gradients exist at the peak only
    # if something keeps them across a backward.
    kept = shards > 1 or num_micro_batches > 1 or layout.pp > 1
    return 4.0 + 2.0, 4.0 if kept else 0.0, 8.0


def usable_bytes(memory_gib: float) -> float:
    return memory_gib * GIB * USABLE_FRACTION

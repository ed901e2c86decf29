"""Bytes per GPU of a training step: weights, gradients, optimizer state, activations, logits.

Precision is Megatron's bf16 scheme: bf16 weights (2 bytes), fp32 main gradients (4) and
an fp32 master copy plus Adam's two moments in the optimizer (12): 18 bytes per
parameter, of which the distributed optimizer shards the 12 over data parallel (x context
parallel) and FSDP shards all 18. (tessera's single-GPU AMP trainer holds fp32 weights,
their bf16 casts, fp32 gradients and the two moments: the same 18 bytes.)

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

The pipeline decides how many micro-batches are alive: under 1F1B the first stage holds
min(p, m) of them; under the interleaved schedule min(m*v, 2(p-1) + (v-1)p + 1) model
chunks (Megatron's warm-up count plus the one in flight), which is the paper's
L x (1 + (p-1)/(pv)) layers' worth.
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
    stage: str           # which pipeline stage this is ("first", "last", "only")

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
    masks = 2 * s * b * h if model.hidden_dropout > 0 else 0.0
    sequence_sharded = 4 * s * b * h + 2 * s * b * h + 2 * s * b * h + masks
    if layout.recompute == "full":
        return 2 * s * b * h / (t if layout.sequence_parallel else 1)
    gated = 2 if model.swiglu else 1
    # With torch.compile the fused activation kernel recomputes the MLP's activated output
    # (fc2's input) from fc1's output in backward instead of saving it (Inductor's min-cut).
    fc2_input = 0.0 if layout.compiled else 2 * s * b * f
    tensor_sharded = 2 * s * b * (q + 2 * kv) + 2 * s * b * q + 2 * s * b * f * gated + fc2_input
    if layout.recompute != "selective":
        if fused_attention:
            tensor_sharded += 4 * s * b * a
        else:
            per_score = 5 if model.attention_dropout > 0 else 2   # scores, and mask + dropout output
            tensor_sharded += per_score * a * s * s * b
    return sequence_sharded / (t if layout.sequence_parallel else 1) + tensor_sharded / t


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


def stage_parameters(model: ModelConfig, layout: Layout, vocab_size: int, stage: str) -> float:
    """Parameters held by one GPU of a pipeline stage ('first', 'last' or 'only')."""
    h = model.hidden_size
    layers = model.num_layers / layout.pp
    params = layers * _params_per_layer(model) / layout.tp
    word_embedding = vocab_size * h / layout.tp
    positions = model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0
    if stage in ("first", "only"):
        params += word_embedding + positions
    if stage in ("last", "only"):
        params += h * (2 if model.normalization == "LayerNorm" else 1)
        # An untied output layer, or the copy of the tied embedding the last stage keeps.
        if not model.tie_embeddings or stage == "last":
            params += word_embedding
    return params


def estimate_memory(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int,
                    vocab_size: int | None = None) -> MemoryBreakdown:
    """Peak bytes on the fullest GPU of the layout (the largest of its pipeline stages)."""
    vocab = vocab_size if vocab_size is not None else model.padded_vocab_size(layout.tp)
    stages = ["only"] if layout.pp == 1 else ["first", "last"]
    return max((_stage_memory(model, layout, global_batch_size, seq_length, vocab, stage) for stage in stages),
               key=lambda m: m.total)


def _stage_memory(model: ModelConfig, layout: Layout, global_batch_size: int, seq_length: int,
                  vocab: int, stage: str) -> MemoryBreakdown:
    params = stage_parameters(model, layout, vocab, stage)
    shards = layout.dp * layout.cp
    weights, gradients, optimizer = 2.0 * params, 4.0 * params, 12.0 * params
    buffers = 0.0
    if layout.fsdp:
        weights, gradients, optimizer = weights / shards, gradients / shards, optimizer / shards
        # The layer being computed and the one being prefetched, unsharded (bf16 weights, fp32 grads).
        buffers += 2 * 6.0 * _params_per_layer(model) / layout.tp
    elif layout.distributed_optimizer:
        optimizer /= shards

    s, b, h = seq_length / layout.cp, layout.micro_batch_size, model.hidden_size
    per_layer = layer_activation_bytes(model, layout, seq_length)
    layers_per_chunk = model.num_layers / (layout.pp * layout.virtual_stages)
    index = layout.pp - 1 if stage == "last" else 0
    chunks = chunks_in_flight(layout, layout.num_micro_batches(global_batch_size), index)
    activations = chunks * layers_per_chunk * per_layer
    if layout.recompute == "full":
        # Backward recomputes one layer at a time: its full activations exist briefly.
        activations += layer_activation_bytes(model, replace(layout, recompute="none"), seq_length)
    logits = 6.0 * s * b * vocab / layout.tp if stage in ("last", "only") else 0.0  # bf16 logits + fp32 softmax
    if layout.sequence_parallel:
        buffers += 2.0 * s * b * h  # the all-gathered input of the GEMM being computed
    return MemoryBreakdown(weights, gradients, optimizer, activations, logits, buffers, stage)


def usable_bytes(memory_gib: float) -> float:
    return memory_gib * GIB * USABLE_FRACTION

"""Predicted step time, TFLOP/s/GPU and MFU of a model in a layout on a cluster.

The step is built from what each GPU does, as Megatron-LM schedules it:

1. One micro-batch through one layer: each GEMM (forward, input-gradient, weight-gradient
   shapes) timed on the GEMM curve, fused causal attention on the attention curve,
   norms/activations/residuals/RoPE from their HBM bytes (tessera.perf.kernels), and the
   tensor-parallel collectives (tessera.perf.cluster). A collective that Megatron runs
   beside a GEMM costs only what the GEMM does not cover, plus its link's interference
   share of the covered part (both compete for SMs and HBM).
2. A pipeline rank's micro-batch time is its layers (uneven splits give ranks different
   counts) plus, on the last rank, the output layer and the loss (the embedding lookup on
   the first is a row copy per token, not timed). The step is m micro-batch times of the
   slowest rank plus the fill and the drain: every other rank's micro-batch time once,
   over v chunks - (p-1)/v micro-batch times when the ranks are equal, the bubble of
   1F1B and interleaved 1F1B. The first/last transfers of the fill and drain cannot hide;
   tessera's runner also waits for the transfers after every chunk's forward and backward.
3. Gradients are reduce-scattered (distributed optimizer), all-reduced (DDP) or
   reduce-scattered per layer (FSDP) over data x context parallel, in fp32; parameters are
   all-gathered in bf16. With overlap only what the last micro-batch's backward (or the
   first's forward, for the gather) cannot cover is exposed, and never less than one
   bucket. Then the optimizer step reads and writes its shard at HBM speed.

Model FLOPs (for MFU) are Megatron's formula; the time is for the work really done
(causal attention skips half the scores, recomputation is extra).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from tessera.config import ConfigError, ModelConfig
from tessera.perf.cluster import Cluster, Link
from tessera.perf.flops import flops_per_iteration
from tessera.perf.kernels import KernelCurves
from tessera.perf.layout import Layout
from tessera.perf.memory import MemoryBreakdown, estimate_memory, stage_parameters

# Bytes a parameter costs in the optimizer step: Adam reads fp32 param, grad, m, v (16),
# writes param, m, v (12) and the bf16 copy (2); the grad-norm reads the grad again (4).
OPTIMIZER_BYTES_PER_PARAM = 34.0
# Bytes per logit of Megatron's unfused vocab-parallel cross-entropy. Forward: transpose
# to contiguous (2+2), .float() (2+4), max (4), subtract (4+4), exp (4+4), sum (4),
# divide (4+4) = 42; backward: scale the saved softmax (4+4), cast to bf16 (4+2),
# transpose back (2+2) = 18.
CROSS_ENTROPY_BYTES = (42.0, 18.0)
GRAD_BYTES, PARAM_GATHER_BYTES = 4.0, 2.0  # fp32 gradient reduction, bf16 parameter gather


def _overlapped(comm: float, compute: float, overlap: bool, link: Link) -> float:
    """What a collective adds to the step when it runs beside `compute` seconds of kernels."""
    if not overlap:
        return comm
    return max(comm - compute, 0.0) + link.interference * min(comm, compute)


@dataclass
class Phase:
    """Seconds by category for one pass (forward or backward) of one micro-batch."""

    times: dict = field(default_factory=dict)

    def add(self, category: str, seconds: float) -> None:
        self.times[category] = self.times.get(category, 0.0) + seconds

    def extend(self, other: "Phase", scale: float = 1.0, rename: str | None = None) -> None:
        for category, seconds in other.times.items():
            self.add(rename or category, seconds * scale)

    @property
    def total(self) -> float:
        return sum(self.times.values())


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_time: float                 # seconds per iteration
    breakdown: dict                  # seconds per iteration by category (slowest stage)
    memory: MemoryBreakdown
    model_flops: float               # per iteration, Megatron's formula
    gpus: int
    peak_flops: float                # per GPU
    tokens_per_iteration: int

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_time / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step_time / self.gpus / self.peak_flops

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens_per_iteration / self.step_time


class StepModel:
    """Times the pieces of a training step for one model, sequence and cluster."""

    def __init__(self, model: ModelConfig, cluster: Cluster, curves: KernelCurves, seq_length: int,
                 dtype: str = "bf16"):
        self.model, self.cluster, self.curves, self.seq = model, cluster, curves, seq_length
        self.peak = cluster.gpu.peak_tflops[dtype] * 1e12
        self.hbm = cluster.gpu.hbm_tb_per_s * 1e12 * curves.hbm_efficiency

    def _gemm(self, m: float, n: float, k: float) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) seconds of a GEMM with forward shape m x n x k."""
        time = lambda a, b, c: self.curves.gemm_time(int(a), int(b), int(c), self.peak, self.hbm / self.curves.hbm_efficiency)
        return time(m, n, k), time(m, k, n), time(k, n, m)

    def layer(self, layout: Layout) -> tuple[Phase, Phase]:
        """Forward and backward of one transformer layer for one micro-batch on one GPU."""
        model, t = self.model, layout.tp
        tokens = layout.micro_batch_size * self.seq / layout.cp
        h, f = model.hidden_size, model.ffn_hidden_size
        q = model.num_attention_heads * model.kv_channels
        kv = model.num_query_groups * model.kv_channels
        gated = 2 if model.swiglu else 1
        qkv = self._gemm(tokens, (q + 2 * kv) / t, h)
        proj = self._gemm(tokens, h, q / t)
        fc1 = self._gemm(tokens, gated * f / t, h)
        fc2 = self._gemm(tokens, h, f / t)
        fwd, bwd = Phase(), Phase()
        fwd.add("gemm", qkv[0] + proj[0] + fc1[0] + fc2[0])
        bwd.add("gemm", sum(qkv[1:] + proj[1:] + fc1[1:] + fc2[1:]))

        # Causal: every query sees half the sequence on average (CP balances the halves).
        attention_flops = 2.0 * tokens * self.seq * q / t
        efficiency = self.curves.attention_efficiency(int(self.seq / layout.cp)) * self.peak
        if model.attention_dropout > 0:
            efficiency /= 1.0 + self.curves.attn_dropout_cost
        fwd.add("attention", attention_flops / efficiency)
        bwd.add("attention", 2.5 * attention_flops / efficiency)  # dQ, dK, dV and the recomputed scores

        # Bytes per token: two norms and two residual adds on h (sharded by SP), the
        # activation function on f, RoPE on q and k.
        sp = t if layout.sequence_parallel else 1
        act_fwd, act_bwd = (6 * f, 10 * f) if model.swiglu else (4 * f, 6 * f)
        rope = 4 * (q + kv) if model.position_embedding_type == "rope" else 0
        fwd.add("memory_bound", tokens * (20 * h / sp + (act_fwd + rope) / t) / self.hbm)
        bwd.add("memory_bound", tokens * (20 * h / sp + (act_bwd + rope) / t) / self.hbm)
        if layout.sequence_parallel and layout.framework == "tessera":
            # tessera's activations are [batch, seq, hidden]: each of the pass's two all-gathers
            # and two reduce-scatters along seq copies its input and output to and from
            # seq-first layout (bf16, read + write, the full and the 1/t tensor).
            transposes = 4 * 2 * 2 * tokens * h * (1 + 1 / t)
            fwd.add("memory_bound", transposes / self.hbm)
            bwd.add("memory_bound", transposes / self.hbm)

        if t > 1:
            self._tensor_parallel_comm(layout, tokens * h * 2, qkv, proj, fc1, fc2, fwd, bwd)
        if layout.cp > 1:
            self._context_parallel_comm(layout, tokens, kv, fwd, bwd)
        return fwd, bwd

    def _tensor_parallel_comm(self, layout, nbytes, qkv, proj, fc1, fc2, fwd: Phase, bwd: Phase) -> None:
        """Megatron's TP collectives per layer, each beside the GEMM it can hide behind.

        Without --tp-comm-overlap only the backward's collectives on the weight-gradient
        and input-gradient paths run asynchronously (Megatron's default); with it, TE
        userbuffers pipeline every collective with its GEMM. tessera runs each collective
        between its GEMMs (none hidden) and keeps the gathered GEMM inputs, so its backward
        has the forward's collectives conjugated and no re-gather.
        """
        ranks, per_node = layout.tp, min(layout.tp, self.cluster.gpus_per_node)
        link = self.cluster.link(ranks, per_node)
        tpo = layout.tp_comm_overlap

        def beside(comm: float, gemm: float, overlap: bool) -> float:
            return _overlapped(comm, gemm, overlap, link)

        if layout.framework == "tessera":
            forward = 2 * (self.cluster.all_gather(nbytes, ranks, per_node)
                           + self.cluster.reduce_scatter(nbytes, ranks, per_node)) \
                if layout.sequence_parallel else 2 * self.cluster.all_reduce(nbytes, ranks, per_node)
            fwd.add("tp_comm", forward)
            bwd.add("tp_comm", forward)
        elif layout.sequence_parallel:
            gather = self.cluster.all_gather(nbytes, ranks, per_node)
            scatter = self.cluster.reduce_scatter(nbytes, ranks, per_node)
            fwd.add("tp_comm", beside(gather, qkv[0], tpo) + beside(scatter, proj[0], tpo)
                    + beside(gather, fc1[0], tpo) + beside(scatter, fc2[0], tpo))
            # Per linear: gather dY (row-parallel), or reduce-scatter dX beside the weight
            # gradient and re-gather X beside the input gradient (column-parallel).
            bwd.add("tp_comm", beside(gather, fc2[1], tpo) + beside(gather, proj[1], tpo)
                    + beside(scatter, fc1[2], True) + beside(gather, fc1[1], True)
                    + beside(scatter, qkv[2], True) + beside(gather, qkv[1], True))
        else:
            reduce = self.cluster.all_reduce(nbytes, ranks, per_node)
            fwd.add("tp_comm", beside(reduce, proj[0], tpo) + beside(reduce, fc2[0], tpo))
            bwd.add("tp_comm", beside(reduce, fc1[2], True) + beside(reduce, qkv[2], True))

    def _context_parallel_comm(self, layout: Layout, tokens: float, kv: int, fwd: Phase, bwd: Phase) -> None:
        """Ring attention: cp-1 exchanges of a K, V block forward; K, V and dK, dV backward."""
        block = tokens * 2 * kv / layout.tp * 2
        across = layout.tp * layout.cp > self.cluster.gpus_per_node
        ring = (layout.cp - 1) * self.cluster.send(block, across)
        link = self.cluster.network if across else self.cluster.nvlink
        fwd.add("cp_comm", _overlapped(ring, fwd.times["attention"], True, link))
        bwd.add("cp_comm", _overlapped(2 * ring, bwd.times["attention"], True, link))

    def output_layer(self, layout: Layout, vocab: int) -> tuple[Phase, Phase]:
        """Logits GEMM and vocab-parallel cross-entropy for one micro-batch (last stage)."""
        tokens = layout.micro_batch_size * self.seq / layout.cp
        logits = self._gemm(tokens, vocab / layout.tp, self.model.hidden_size)
        fwd, bwd = Phase(), Phase()
        fwd.add("gemm", logits[0])
        bwd.add("gemm", logits[1] + logits[2])
        logits_bytes = tokens * vocab / layout.tp
        fwd.add("memory_bound", logits_bytes * CROSS_ENTROPY_BYTES[0] / self.hbm)
        bwd.add("memory_bound", logits_bytes * CROSS_ENTROPY_BYTES[1] / self.hbm)
        return fwd, bwd


def predict(model: ModelConfig, layout: Layout, cluster: Cluster, curves: KernelCurves,
            global_batch_size: int, seq_length: int, causal_flops: bool = True,
            dtype: str = "bf16") -> Prediction:
    """Step time, memory and MFU of one layout (checked beforehand with check_layout)."""
    steps = StepModel(model, cluster, curves, seq_length, dtype)
    vocab = model.padded_vocab_size(layout.tp)
    micro_batches = layout.num_micro_batches(global_batch_size)
    layer_fwd, layer_bwd = steps.layer(layout)
    output = steps.output_layer(layout, vocab)
    per_rank = layout.layers_per_rank(model.num_layers)
    passes = [_micro_batch_passes(layer_fwd, layer_bwd, layers, layout.recompute, output if rank == layout.pp - 1 else None)
              for rank, layers in enumerate(per_rank)]
    times = [fwd.total + bwd.total for fwd, bwd in passes]
    slowest = times.index(max(times))
    fwd, bwd = passes[slowest]

    step = Phase()
    step.extend(fwd, micro_batches)
    step.extend(bwd, micro_batches)
    if layout.pp > 1:
        step.add("pp_bubble", (sum(times) - times[slowest]) / layout.virtual_stages)
        boundary = layout.micro_batch_size * seq_length / layout.cp * model.hidden_size * 2
        boundary /= layout.tp if layout.sequence_parallel else 1
        across = layout.gpus // layout.pp >= cluster.gpus_per_node
        hops = 2 * (layout.pp * layout.virtual_stages - 1)  # the fill and the drain
        if layout.framework == "tessera":   # its runner waits for each batch of transfers
            hops += 2 * layout.virtual_stages * micro_batches
        step.add("pp_p2p", hops * cluster.send(boundary, across))
        if model.tie_embeddings:  # first and last stage sum their embedding gradients
            embedding = vocab * model.hidden_size / layout.tp * GRAD_BYTES
            step.add("dp_comm", cluster.all_reduce(embedding, 2, 1))
    params = stage_parameters(model, layout, vocab, slowest)
    _data_parallel(step, steps, layout, params, layer_fwd, layer_bwd, fwd.total, bwd.total, micro_batches,
                   per_rank[slowest])

    memory = estimate_memory(model, layout, global_batch_size, seq_length, vocab)
    model_flops = flops_per_iteration(model, global_batch_size, seq_length, vocab, causal=causal_flops)
    return Prediction(layout, step.total, step.times, memory, model_flops, layout.gpus, steps.peak,
                      global_batch_size * seq_length)


def balance_pipeline(model: ModelConfig, layout: Layout, cluster: Cluster, curves: KernelCurves,
                     seq_length: int) -> Layout:
    """The layout with --decoder-first/last-pipeline-num-layers set so that the slowest
    pipeline rank is as fast as it can be (the even split if nothing beats it).

    The last rank also runs the output layer and the loss (about 2 layers' worth for a 50k
    vocabulary at h = 2048), so it usually gives layers to the first. Splits within a few
    layers of even are tried; the step time falls with the slowest rank's time, because the
    sum of all ranks' times (the fill and the drain) does not depend on the split.
    """
    if layout.pp == 1:
        return layout
    steps = StepModel(model, cluster, curves, seq_length)
    layer_fwd, layer_bwd = steps.layer(layout)
    layer = sum(phase.total for phase in _micro_batch_passes(layer_fwd, layer_bwd, 1, layout.recompute, None))
    output = sum(phase.total for phase in steps.output_layer(layout, model.padded_vocab_size(layout.tp)))
    even = model.num_layers // (layout.pp * layout.virtual_stages)
    reach = range(max(1, even - math.ceil(output / layer) - 1), even + math.ceil(output / layer) + 2)

    def cost(first: int | None, last: int | None) -> tuple[float, int]:
        """(slowest rank's time in layers, stages' distance from even): among equally fast
        splits the nearest to even, whose chunks stay alike under interleaving."""
        candidate = replace(layout, first_stage_layers=first, last_stage_layers=last)
        per_rank = candidate.layers_per_rank(model.num_layers)
        slowest = max(layers * layer + (output if rank == layout.pp - 1 else 0.0) for rank, layers in enumerate(per_rank))
        return round(slowest / layer, 6), sum(abs(size - even) for size in candidate.stage_layers(model.num_layers))

    options = {}
    for first, last in itertools.product([None, *reach], repeat=2):
        try:
            options[(first, last)] = cost(first, last)
        except ConfigError:   # the other stages cannot split the rest evenly
            continue
    first, last = min(options, key=options.get)
    return replace(layout, first_stage_layers=first, last_stage_layers=last)


def _micro_batch_passes(layer_fwd: Phase, layer_bwd: Phase, layers: int, recompute: str,
                        output: tuple[Phase, Phase] | None) -> tuple[Phase, Phase]:
    """Forward and backward of one micro-batch on a pipeline rank with `layers` layers (and
    the output layer and loss on the last rank)."""
    fwd, bwd = Phase(), Phase()
    fwd.extend(layer_fwd, layers)
    bwd.extend(layer_bwd, layers)
    if recompute == "full":
        bwd.extend(layer_fwd, layers, rename="recompute")
    elif recompute == "selective":
        bwd.add("recompute", layers * layer_fwd.times["attention"])
    if output is not None:
        fwd.extend(output[0])
        bwd.extend(output[1])
    return fwd, bwd


def _data_parallel(step: Phase, steps: StepModel, layout: Layout, params: float, layer_fwd: Phase,
                   layer_bwd: Phase, fwd_time: float, bwd_time: float, micro_batches: int, layers: int) -> None:
    """Gradient reduction, parameter gathering and the optimizer step."""
    cluster = steps.cluster
    ranks = layout.dp * layout.cp
    per_node = min(ranks, max(1, cluster.gpus_per_node // layout.tp))
    link = cluster.link(ranks, per_node)
    bucket = max(40e6, 1e6 * layout.dp) / layout.tp  # Megatron's default bucket, in this GPU's params
    sharded = layout.distributed_optimizer or layout.fsdp
    if ranks > 1 and layout.fsdp:
        # Per layer and micro-batch: gather bf16 weights for forward and again for backward,
        # reduce-scatter fp32 gradients; prefetching hides them behind the layer's compute.
        layer_params = params / layers
        gather = cluster.all_gather(layer_params * PARAM_GATHER_BYTES, ranks, per_node)
        scatter = cluster.reduce_scatter(layer_params * GRAD_BYTES, ranks, per_node)
        per_layer = _overlapped(gather, layer_fwd.total, True, link) + \
            _overlapped(gather + scatter, layer_bwd.total, True, link)
        step.add("dp_comm", micro_batches * layers * per_layer + gather)
    elif ranks > 1 and layout.distributed_optimizer:
        scatter = cluster.reduce_scatter(params * GRAD_BYTES, ranks, per_node)
        gather = cluster.all_gather(params * PARAM_GATHER_BYTES, ranks, per_node)
        last_scatter = cluster.reduce_scatter(bucket * GRAD_BYTES, ranks, per_node)
        first_gather = cluster.all_gather(bucket * PARAM_GATHER_BYTES, ranks, per_node)
        step.add("dp_comm", _exposed(scatter, bwd_time, last_scatter, layout.overlap_grad_reduce, link)
                 + _exposed(gather, fwd_time, first_gather, layout.overlap_param_gather, link))
    elif ranks > 1:
        reduce = cluster.all_reduce(params * GRAD_BYTES, ranks, per_node)
        last = cluster.all_reduce(bucket * GRAD_BYTES, ranks, per_node)
        step.add("dp_comm", _exposed(reduce, bwd_time, last, layout.overlap_grad_reduce, link))
    shard = params / ranks if sharded else params
    step.add("optimizer", (shard * OPTIMIZER_BYTES_PER_PARAM + params * GRAD_BYTES) / steps.hbm)  # + zeroing grads


def _exposed(comm: float, window: float, one_bucket: float, overlap: bool, link: Link) -> float:
    """A bucketed DP collective beside one micro-batch's pass: at least its last bucket shows."""
    if not overlap:
        return comm
    return max(one_bucket, _overlapped(comm, window, True, link))

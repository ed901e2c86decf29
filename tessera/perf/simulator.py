"""Predicted step time, TFLOP/s/GPU and MFU of a model in a layout on a cluster.

The step is built from what each GPU does, as Megatron-LM schedules it:

1. One micro-batch through one layer: each GEMM (forward, input-gradient, weight-gradient
   shapes) timed on the GEMM curve, fused causal attention on the attention curve,
   norms/activations/residuals/RoPE from their HBM bytes (tessera.perf.kernels), and the
   tensor-parallel collectives (tessera.perf.cluster); in a MoE layer also the router,
   the experts' grouped GEMMs and the token dispatch (tessera.perf.moe); multi-latent
   attention as its replicated down projections, column-parallel up projections (their
   collectives move the latents, not the hidden state) and row-parallel output. In a layer
   trained in FP8 the tensor-parallel linears' GEMMs run at the recipe's FP8 rate and add their
   quantisation passes (tessera.perf.fp8); the rest stays bf16. A collective
   that Megatron runs beside a GEMM costs only what the GEMM does not cover, plus its
   link's interference share of the covered part (both compete for SMs and HBM).
2. A pipeline rank's micro-batch time is its layers (uneven splits give ranks different
   counts) plus, on the last rank, the output layer and the loss, and the MTP depths after
   them (each a projection, a layer and the output layer again; the embedding lookup on
   the first is a row copy per token, not timed). The step is m micro-batch times of the
   slowest rank plus the fill and the drain: every other rank's micro-batch time once,
   over v chunks - (p-1)/v micro-batch times when the ranks are equal, the bubble of
   1F1B and interleaved 1F1B. The first/last transfers of the fill and drain cannot hide;
   tessera's runner also waits for the transfers after every chunk's forward and backward.
3. Gradients are reduce-scattered (distributed optimizer), all-reduced (DDP) or
   reduce-scattered per layer (FSDP) over data x context parallel (the routed experts'
   over expert data parallel, after the dense ones), in fp32; parameters are all-gathered
   in bf16, but the FP8 linears' weights in E4M3 with --fp8-param-gather (each rank casts
   its slice after the step; the scales' small all-reduce is not counted). With overlap
   only what the last micro-batch's backward (or the first's forward, for the gather)
   cannot cover is exposed, and never less than one bucket. Then the optimizer step reads
   and writes its shard at HBM speed.

Model FLOPs (for MFU) are Megatron's formula; the time is for the work really done
(causal attention skips half the scores, recomputation is extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.config import ModelConfig
from tessera.perf.cluster import Cluster, Link
from tessera.perf.deepseek import add_mtp_depths, latent_attention
from tessera.perf.flops import _core_attention_width, flops_per_iteration
from tessera.perf.fp8 import fp8_gemm
from tessera.perf.kernels import KernelCurves
from tessera.perf.layout import Layout
from tessera.perf.memory import (MemoryBreakdown, ModelLayers, StageParameters, estimate_memory, residual_bytes,
                                 stage_parameters)
from tessera.perf.moe import add_routed_experts
from tessera.perf.offload import exposed_activation_copies, link_bytes_per_s, offloaded_activation_bytes

# Bytes a parameter costs in the optimizer step: Adam reads fp32 param, grad, m, v (16),
# writes param, m, v (12) and the bf16 copy (2); the grad-norm reads the grad again (4).
# With bf16 moments (Layout.moment_bytes 4 instead of 8) m and v cost half, read and written,
# and masters kept as remainders (Layout.master_bytes 2 instead of 4) write 2 bytes less.
OPTIMIZER_BYTES_PER_PARAM = 34.0
# Bytes per logit of Megatron's unfused vocab-parallel cross-entropy. Forward: transpose
# to contiguous (2+2), .float() (2+4), max (4), subtract (4+4), exp (4+4), sum (4),
# divide (4+4) = 42; backward: scale the saved softmax (4+4), cast to bf16 (4+2),
# transpose back (2+2) = 18.
CROSS_ENTROPY_BYTES = (42.0, 18.0)
GRAD_BYTES, PARAM_GATHER_BYTES = 4.0, 2.0  # fp32 gradient reduction, bf16 parameter gather
FP8_GATHER_BYTES = 1.0   # --fp8-param-gather: the FP8 linears' weights gathered in E4M3
# Bytes per element of casting a bf16 weight slice to E4M3: its amax reads it, the cast reads it
# again and writes 1 byte (tessera.perf.fp8's 2w + 1).
FP8_CAST_BYTES = 5.0


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


# Layout fields that a layer's and the output layer's passes do not depend on (the pipeline, data
# parallelism, the optimizer): StepModel times each pass once per setting of the other fields.
_NOT_PER_LAYER = frozenset({"pp", "dp", "virtual_stages", "first_stage_layers", "last_stage_layers", "recompute",
                            "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                            "overlap_p2p_communication"})


def _per_layer_key(layout: Layout) -> tuple:
    return tuple(value for name, value in layout.__dict__.items() if name not in _NOT_PER_LAYER)


class StepModel:
    """Times the pieces of a training step for one model, sequence and cluster; one StepModel
    shared by many predictions (a search) times each layer setting once."""

    def __init__(self, model: ModelConfig, cluster: Cluster, curves: KernelCurves, seq_length: int,
                 dtype: str = "bf16"):
        self.model, self.cluster, self.curves, self.seq = model, cluster, curves, seq_length
        self.peak = cluster.gpu.peak_tflops[dtype] * 1e12
        self.hbm = cluster.gpu.hbm_tb_per_s * 1e12 * curves.hbm_efficiency
        self.layers_of = ModelLayers.of(model)
        self._passes: dict[tuple, tuple[Phase, Phase] | float] = {}   # read-only once made

    def layer_kinds(self, layout: Layout) -> list[tuple[bool, bool]]:
        """(MoE, FP8) of each layer: the layers whose passes differ."""
        return list(zip(self.layers_of.moe, layout.fp8_layers(self.model.num_layers)))

    def layer(self, layout: Layout, moe: bool = False, fp8: bool = False) -> tuple[Phase, Phase]:
        """Forward and backward of one transformer layer (a MoE layer if `moe`, its tensor-parallel
        linears in FP8 if `fp8`) for one micro-batch on one GPU."""
        key = ("layer", _per_layer_key(layout), moe, fp8)
        if key not in self._passes:
            self._passes[key] = self._layer(layout, moe, fp8)
        return self._passes[key]

    def all_layers(self, layout: Layout) -> float:
        """Seconds of one micro-batch's forward and backward through every layer and the output
        layer (with the MTP depths) one after the other: the pipeline ranks' times summed."""
        key = ("all", _per_layer_key(layout))
        if key not in self._passes:
            passes = [self.layer(layout, *kind) for kind in self.layer_kinds(layout)]
            passes.append(self.output_layer(layout, self.model.padded_vocab_size(layout.tp)))
            self._passes[key] = sum(fwd.total + bwd.total for fwd, bwd in passes)
        return self._passes[key]

    def output_layer(self, layout: Layout, vocab: int) -> tuple[Phase, Phase]:
        """Logits GEMM and vocab-parallel cross-entropy for one micro-batch (last stage), then each
        multi-token prediction depth (tessera.perf.deepseek)."""
        key = ("output", _per_layer_key(layout), vocab)
        if key not in self._passes:
            self._passes[key] = self._output_layer(layout, vocab)
        return self._passes[key]

    def gemm(self, m: float, n: float, k: float, groups: int = 1, peak: float | None = None,
             bytes_per_element: int = 2, curves: KernelCurves | None = None) -> tuple[float, float, float]:
        """(forward, input-gradient, weight-gradient) seconds of a GEMM with forward shape m x n x k
        (a grouped GEMM of `groups` such shapes; at `peak` FLOP/s instead of the dtype's, on `curves`
        instead of the bf16 ones)."""
        curves = curves or self.curves
        hbm = self.hbm / self.curves.hbm_efficiency

        def time(a: float, b: float, c: float) -> float:
            return curves.gemm_time(int(a), int(b), int(c), peak or self.peak, hbm, bytes_per_element, groups)

        return time(m, n, k), time(m, k, n), time(k, n, m)

    def activation_bytes(self, width: float) -> tuple[float, float]:
        """HBM bytes per token of the MLP's activation function on `width` features (forward, backward)."""
        return (6 * width, 10 * width) if self.model.gated_linear_unit else (4 * width, 6 * width)

    def _layer(self, layout: Layout, moe: bool, fp8: bool) -> tuple[Phase, Phase]:
        model, t = self.model, layout.tp
        tokens = layout.micro_batch_size * self.seq / layout.cp
        h = model.hidden_size
        # A MoE layer's dense MLP is its shared expert, if it has one (tessera.perf.moe times the routed experts).
        f = (model.moe_shared_expert_intermediate_size or 0) if moe else model.ffn_hidden_size
        q = model.num_attention_heads * model.kv_channels
        kv = model.num_query_groups * model.kv_channels
        gated = 2 if model.gated_linear_unit else 1
        sp = t if layout.sequence_parallel else 1
        fwd, bwd = Phase(), Phase()

        def linear(m: float, n: float, k: float) -> tuple[float, float, float]:
            return fp8_gemm(self, layout, m, n, k, fwd, bwd) if fp8 else self.gemm(m, n, k)

        if model.multi_latent_attention:
            blocks, collective_bytes, rope = latent_attention(self, layout, tokens, fwd, bwd, linear)
            # For context parallelism: queries and keys are d_qk + d_pe wide per head, values and the output d_v.
            q = kv = _core_attention_width(model)
        else:
            blocks = [(linear(tokens, (q + 2 * kv) / t, h), linear(tokens, h, q / t))]   # (column, row) parallel
            collective_bytes = [(tokens * h * 2,) * 2]
            rope = 4 * (q + kv) if model.position_embedding_type == "rope" else 0
        if f:
            blocks.append((linear(tokens, gated * f / t, h), linear(tokens, h, f / t)))
            collective_bytes.append((tokens * h * 2,) * 2)
        fwd.add("gemm", sum(gemm[0] for block in blocks for gemm in block))
        bwd.add("gemm", sum(gemm[1] + gemm[2] for block in blocks for gemm in block))

        # Causal: every query sees half the sequence on average (CP balances the halves).
        attention_flops = 2.0 * tokens * self.seq * _core_attention_width(model) / t
        efficiency = self.curves.attention_efficiency(int(self.seq / layout.cp)) * self.peak
        if model.attention_dropout > 0:
            efficiency /= 1.0 + self.curves.attn_dropout_cost
        fwd.add("attention", attention_flops / efficiency)
        bwd.add("attention", 2.5 * attention_flops / efficiency)  # dQ, dK, dV and the recomputed scores

        # Bytes per token: two norms and two residual adds on h (sharded by SP), the
        # activation function on f, RoPE on q and k.
        act_fwd, act_bwd = self.activation_bytes(f)
        fwd.add("memory_bound", tokens * (20 * h / sp + (act_fwd + rope) / t) / self.hbm)
        bwd.add("memory_bound", tokens * (20 * h / sp + (act_bwd + rope) / t) / self.hbm)
        if layout.sequence_parallel and layout.framework == "tessera":
            # tessera's activations are [batch, seq, hidden]: each of the pass's all-gathers and
            # reduce-scatters (one of each per block) along seq copies its input and output to and
            # from seq-first layout (bf16, read + write, the full and the 1/t tensor).
            transposes = len(blocks) * 2 * 2 * 2 * tokens * h * (1 + 1 / t)
            fwd.add("memory_bound", transposes / self.hbm)
            bwd.add("memory_bound", transposes / self.hbm)

        if t > 1:
            self._tensor_parallel_comm(layout, collective_bytes, blocks, fwd, bwd)
        if layout.cp > 1:
            self._context_parallel_comm(layout, tokens, q, kv, fwd, bwd)
        if moe:
            add_routed_experts(self, layout, tokens / sp, fwd, bwd, fp8=fp8 and layout.fp8_experts)
        return fwd, bwd

    def _tensor_parallel_comm(self, layout, collective_bytes, blocks, fwd: Phase, bwd: Phase) -> None:
        """Megatron's TP collectives per layer, each beside the GEMM it can hide behind; `blocks`
        are the (column-parallel, row-parallel) GEMM pairs: attention, and the MLP if any, and
        `collective_bytes` the bytes of each pair's input (gathered for the column-parallel GEMM,
        its gradient reduced) and output (reduced, its gradient gathered).

        Without --tp-comm-overlap only the backward's collectives on the weight-gradient
        and input-gradient paths run asynchronously (Megatron's default); with it, TE
        userbuffers pipeline every collective with its GEMM. Without it tessera runs each
        collective between its GEMMs (none hidden) and keeps the gathered GEMM inputs, so its
        backward has the forward's collectives conjugated and no re-gather. With it (SP only)
        tessera's chunked ring (tessera.parallel.tp_overlap) runs each collective under its GEMM
        and keeps only the input shard: the column-parallel backward re-gathers it beside its
        input gradient's GEMM and reduce-scatter (not yet measured on GPUs).
        """
        ranks, per_node = layout.tp, self.cluster.ranks_per_node(layout.tp)
        link = self.cluster.link(ranks, per_node)
        tpo = layout.tp_comm_overlap

        def beside(comm: float, gemm: float, overlap: bool) -> float:
            return _overlapped(comm, gemm, overlap, link)

        def collectives(nbytes: float) -> tuple[float, float, float]:
            return tuple(op(nbytes, ranks, per_node) for op in (self.cluster.all_gather, self.cluster.reduce_scatter,
                                                                  self.cluster.all_reduce))

        for (column, row), (inputs, outputs) in zip(blocks, collective_bytes):
            (gather_in, scatter_in, reduce_in), (gather_out, scatter_out, reduce_out) = map(collectives,
                                                                                           (inputs, outputs))
            if layout.framework == "tessera" and layout.sequence_parallel and tpo:
                fwd.add("tp_comm", beside(gather_in, column[0], True) + beside(scatter_out, row[0], True))
                bwd.add("tp_comm", beside(gather_out, row[1], True) + beside(scatter_in + gather_in, column[1], True))
            elif layout.framework == "tessera":
                sp = layout.sequence_parallel
                fwd.add("tp_comm", gather_in + scatter_out if sp else reduce_out)
                bwd.add("tp_comm", gather_out + scatter_in if sp else reduce_in)
            elif layout.sequence_parallel:
                fwd.add("tp_comm", beside(gather_in, column[0], tpo) + beside(scatter_out, row[0], tpo))
                # Gather dY for the row-parallel GEMM; reduce-scatter dX beside the column-parallel
                # one's weight gradient and re-gather X beside its input gradient.
                bwd.add("tp_comm", beside(gather_out, row[1], tpo) + beside(scatter_in, column[2], True)
                        + beside(gather_in, column[1], True))
            else:
                fwd.add("tp_comm", beside(reduce_out, row[0], tpo))
                bwd.add("tp_comm", beside(reduce_in, column[2], True))

    def _context_parallel_comm(self, layout: Layout, tokens: float, q: int, kv: int, fwd: Phase, bwd: Phase
                               ) -> None:
        """Context parallelism's traffic per layer (--cp-comm-type; tessera.parallel.context):

            p2p         cp-1 K, V blocks forward; K, V and dK, dV backward; beside the attention
            all_gather  K, V all-gathered (forward, and again backward), dK, dV reduce-scattered; not hidden
            a2a         Q, K, V and the output all-to-all forward, their gradients backward; not hidden
            a2a+p2p     the all-to-alls inside groups of cp_a2a_size ranks, the ring across them

        CP ranks are TP ranks apart; a rank's K, V block is bf16 and the same size after an
        all-to-all (its group's tokens, 1/group of the heads)."""
        t, cp, cluster, kind = layout.tp, layout.cp, self.cluster, layout.cp_comm_type
        block = tokens * 2 * kv / t * 2
        inner = {"a2a": cp, "a2a+p2p": layout.cp_a2a_size or 1}.get(kind, 1)
        if inner > 1:
            exchange = cluster.all_to_all(tokens * (2 * q + 2 * kv) / t * 2, inner, cluster.ranks_per_node(inner, t))
            fwd.add("cp_comm", exchange)
            bwd.add("cp_comm", exchange)
        if kind == "all_gather":
            gather = cluster.all_gather(cp * block, cp, cluster.ranks_per_node(cp, t))
            fwd.add("cp_comm", gather)
            bwd.add("cp_comm", 2 * gather)   # the gather again, and the reduce-scatter of dK, dV
        elif cp // inner > 1:
            across = t * cp > cluster.gpus_per_node
            ring = (cp // inner - 1) * cluster.send(block, across)
            link = cluster.network if across else cluster.nvlink
            fwd.add("cp_comm", _overlapped(ring, fwd.times["attention"], True, link))
            bwd.add("cp_comm", _overlapped(2 * ring, bwd.times["attention"], True, link))

    def _output_layer(self, layout: Layout, vocab: int) -> tuple[Phase, Phase]:
        model, t = self.model, layout.tp
        tokens = layout.micro_batch_size * self.seq / layout.cp
        logits = self.gemm(tokens, vocab / t, model.hidden_size)
        fwd, bwd = Phase(), Phase()
        fwd.add("gemm", logits[0])
        bwd.add("gemm", logits[1] + logits[2])
        logits_bytes = tokens * vocab / t
        fwd.add("memory_bound", logits_bytes * CROSS_ENTROPY_BYTES[0] / self.hbm)
        bwd.add("memory_bound", logits_bytes * CROSS_ENTROPY_BYTES[1] / self.hbm)
        if model.mtp_num_layers:
            add_mtp_depths(self, layout, fwd, bwd)
        return fwd, bwd


def predict(model: ModelConfig, layout: Layout, cluster: Cluster, curves: KernelCurves,
            global_batch_size: int, seq_length: int, causal_flops: bool = True,
            dtype: str = "bf16", steps: StepModel | None = None) -> Prediction:
    """Step time, memory and MFU of one layout (checked beforehand with check_layout); `steps`,
    the StepModel of the same model, cluster, curves, sequence and dtype, to share its timings."""
    steps = steps or StepModel(model, cluster, curves, seq_length, dtype)
    vocab = model.padded_vocab_size(layout.tp)
    micro_batches = layout.num_micro_batches(global_batch_size)
    output = steps.output_layer(layout, vocab)
    rank_layers = _rank_layer_passes(steps, layout)
    passes = [micro_batch_passes(layers, layout.recompute, output if rank == layout.pp - 1 else None)
              for rank, layers in enumerate(rank_layers)]
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
        if layout.framework == "tessera" and not layout.overlap_p2p_communication:
            hops += 2 * layout.virtual_stages * micro_batches   # its runner waits for each batch of transfers
        step.add("pp_p2p", hops * cluster.send(boundary, across))
        if model.tie_embeddings:  # first and last stage sum their embedding gradients
            embedding = vocab * model.hidden_size / layout.tp * GRAD_BYTES
            step.add("dp_comm", cluster.all_reduce(embedding, 2, 1))
    params = stage_parameters(model, layout, vocab, slowest, steps.layers_of)
    _data_parallel(step, steps, layout, params, rank_layers[slowest], fwd.total, bwd.total, micro_batches)

    memory = estimate_memory(model, layout, global_batch_size, seq_length, vocab, steps.layers_of)
    _offload(step, steps, layout, layout.rank_layers(model.num_layers)[slowest], fwd.total, bwd.total, micro_batches,
             memory.host)
    model_flops = flops_per_iteration(model, global_batch_size, seq_length, vocab, causal=causal_flops)
    return Prediction(layout, step.total, step.times, memory, model_flops, layout.gpus, steps.peak,
                      global_batch_size * seq_length)


def _offload(step: Phase, steps: StepModel, layout: Layout, layers: list[int], fwd_time: float, bwd_time: float,
             micro_batches: int, host_state: float) -> None:
    """The host link's share of the step (tessera.perf.offload): each micro-batch's activation
    copies where they outlast its passes, and the offloaded optimizer state up and down."""
    link = link_bytes_per_s(steps.cluster.gpu)
    if layout.offload_modules:
        residual, moe = residual_bytes(layout), steps.layers_of.moe
        offloaded = sum(offloaded_activation_bytes(steps.model, layout, steps.seq, residual, moe[i]) for i in layers)
        step.add("offload", micro_batches * exposed_activation_copies(offloaded, fwd_time, bwd_time, link))
    if host_state:
        step.add("offload", host_state / link)


def _rank_layer_passes(steps: StepModel, layout: Layout) -> list[list[tuple[Phase, Phase]]]:
    """Per pipeline rank, the (forward, backward) of one micro-batch through each of its layers."""
    kinds = steps.layer_kinds(layout)
    passes = {kind: steps.layer(layout, *kind) for kind in set(kinds)}
    return [[passes[kinds[i]] for i in layers] for layers in layout.rank_layers(steps.model.num_layers)]


def micro_batch_passes(layers: list[tuple[Phase, Phase]], recompute: str,
                        output: tuple[Phase, Phase] | None) -> tuple[Phase, Phase]:
    """Forward and backward of one micro-batch on a pipeline rank through its `layers` (and
    the output layer and loss on the last rank)."""
    fwd, bwd = Phase(), Phase()
    for layer_fwd, layer_bwd in layers:
        fwd.extend(layer_fwd)
        bwd.extend(layer_bwd)
        if recompute == "full":
            bwd.extend(layer_fwd, rename="recompute")
        elif recompute == "selective":
            bwd.add("recompute", layer_fwd.times["attention"])
    if output is not None:
        fwd.extend(output[0])
        bwd.extend(output[1])
    return fwd, bwd


def _data_parallel(step: Phase, steps: StepModel, layout: Layout, params: StageParameters,
                   layers: list[tuple[Phase, Phase]], fwd_time: float, bwd_time: float, micro_batches: int) -> None:
    """Gradient reduction, parameter gathering and the optimizer step: dense parameters over
    DP x CP, the routed experts over their own replicas (EDP), both beside the same backward."""
    cluster = steps.cluster
    # Bytes per parameter of each group's all-gather: bf16, but with --fp8-param-gather the FP8
    # linears' weights in E4M3 (the dense parameters' average, their buckets' too).
    fp8_weights = params.fp8_linears if layout.fp8_param_gather else 0.0
    dense_gather = PARAM_GATHER_BYTES - (PARAM_GATHER_BYTES - FP8_GATHER_BYTES) * fp8_weights / params.dense
    groups = [(params.dense, dense_gather, layout.dp * layout.cp,
               cluster.ranks_per_node(layout.dp * layout.cp, layout.tp)),
              (params.experts, PARAM_GATHER_BYTES, layout.edp,
               cluster.ranks_per_node(layout.edp, layout.ep * layout.expert_tp))]
    groups = [(count, gather_bytes, ranks, per_node, cluster.link(ranks, per_node))
              for count, gather_bytes, ranks, per_node in groups if count and ranks > 1]
    sharded = layout.distributed_optimizer or layout.fsdp
    if groups:
        _, gather_bytes, ranks, per_node, _ = groups[0]
        bucket = max(40e6, 1e6 * layout.dp) / layout.tp  # Megatron's default bucket, in this GPU's params
        if layout.fsdp:
            # Per layer and micro-batch: gather bf16 weights (the FP8 linears' in E4M3 with
            # --fp8-param-gather) for forward and again for backward, reduce-scatter fp32
            # gradients; prefetching hides them behind the layer's compute.
            gather = [(cluster.all_gather(count / len(layers) * nbytes, r, n), link)
                      for count, nbytes, r, n, link in groups]
            scatter = [(cluster.reduce_scatter(count / len(layers) * GRAD_BYTES, r, n), link)
                       for count, _, r, n, link in groups]
            layer_fwd = sum(fwd.total for fwd, _ in layers) / len(layers)
            layer_bwd = sum(bwd.total for _, bwd in layers) / len(layers)
            per_layer = _exposed(gather, layer_fwd, 0.0, True) + _exposed(gather + scatter, layer_bwd, 0.0, True)
            step.add("dp_comm", micro_batches * len(layers) * per_layer + sum(seconds for seconds, _ in gather))
        elif layout.distributed_optimizer:
            scatter = [(cluster.reduce_scatter(count * GRAD_BYTES, r, n), link) for count, _, r, n, link in groups]
            gather = [(cluster.all_gather(count * nbytes, r, n), link) for count, nbytes, r, n, link in groups]
            last_scatter = cluster.reduce_scatter(bucket * GRAD_BYTES, ranks, per_node)
            first_gather = cluster.all_gather(bucket * gather_bytes, ranks, per_node)
            step.add("dp_comm", _exposed(scatter, bwd_time, last_scatter, layout.overlap_grad_reduce)
                     + _exposed(gather, fwd_time, first_gather, layout.overlap_param_gather))
        else:
            reduce = [(cluster.all_reduce(count * GRAD_BYTES, r, n), link) for count, _, r, n, link in groups]
            last = cluster.all_reduce(bucket * GRAD_BYTES, ranks, per_node)
            step.add("dp_comm", _exposed(reduce, bwd_time, last, layout.overlap_grad_reduce))
    shard = params.dense / (layout.dp * layout.cp) + params.experts / layout.edp if sharded else params.total
    # The shard's update, and zeroing every gradient.
    sharded_state = layout.distributed_optimizer and not layout.fsdp
    moments_saved = 8.0 - layout.moment_bytes if sharded_state else 0.0
    masters_saved = 4.0 - layout.master_bytes if sharded_state else 0.0
    # Each moment byte is read and written; a remainder master reads what the fp32 one did (the
    # weight and the remainder) and writes 2 bytes less.
    per_param = OPTIMIZER_BYTES_PER_PARAM - 2 * moments_saved - masters_saved
    # --fp8-param-gather: each rank casts its slice of the FP8 linears' weights to E4M3 for the gather.
    fp8_casts = FP8_CAST_BYTES * fp8_weights / (layout.dp * layout.cp)
    step.add("optimizer", (shard * per_param + params.total * GRAD_BYTES + fp8_casts) / steps.hbm)


def _exposed(comms: list[tuple[float, Link]], window: float, one_bucket: float, overlap: bool) -> float:
    """Bucketed DP collectives (seconds, link) beside one micro-batch's pass: at least the last bucket
    shows, and never more than without the overlap (all of it, when it is one bucket)."""
    total = sum(seconds for seconds, _ in comms)
    if not overlap or not total:
        return total
    interference = sum(seconds * link.interference for seconds, link in comms) / total
    return min(total, max(one_bucket, max(total - window, 0.0) + interference * min(total, window)))

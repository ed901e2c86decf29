"""Megatron-Core's published H100 scaling runs, and the planner's predictions for them.

Source: Megatron-LM's README, release r0.8.0 (July 2024), its weak and strong scaling tables.
Every run: GPT with vocabulary 131,072, sequence 4,096, FFN 4h, bf16, DGX H100 nodes,
--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap (and so the distributed
optimizer and sequence parallelism). MFU there is TFLOP/s / 989 with the FLOPs formula of
the time, which did not halve causal attention; the predictions use the same count.

What the sources do not state -- micro-batch size and interleaving -- the planner chooses:
the fastest layout that fits, with TP, PP and DP held at the published values.

One MoE point: Megatron-Core's MoE README (v0.9) gives 468 TFLOP/s/GPU for Mixtral 8x7B in
bf16 without its setup; the README's H100 reference mapping for that model is taken as the
setup, counted with the FLOPs formula of the time
(no causal halving; its k x ffn equals k x moe_ffn for Mixtral).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.config import ModelConfig
from tessera.models.presets import preset_values
from tessera.perf.cluster import CLUSTERS
from tessera.perf.kernels import KernelCurves, load_curves
from tessera.perf.layout import Layout
from tessera.perf.search import SearchSpace, search
from tessera.perf.simulator import Prediction, predict

SEQ_LENGTH, VOCAB_SIZE = 4096, 131072
CLUSTER = CLUSTERS["dgx-h100"]


@dataclass(frozen=True)
class PublishedRun:
    label: str               # model size, as published
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch_size: int
    mfu: float | None        # published MFU (fraction), None where only the chart has it

    def model(self) -> ModelConfig:
        return ModelConfig(num_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                           seq_length=SEQ_LENGTH, vocab_size=VOCAB_SIZE)


# Weak scaling (README model table): DP = 48 on every row.
WEAK_SCALING = [
    PublishedRun("1.7B", 16, 2048, 24, 1, 1, 48, 192, 0.41),
    PublishedRun("7.1B", 32, 4096, 30, 2, 1, 96, 192, 0.47),
    PublishedRun("16B", 48, 6144, 32, 4, 1, 192, 192, 0.49),
    PublishedRun("32B", 56, 7168, 48, 8, 1, 384, 192, 0.46),
    PublishedRun("70B", 64, 8192, 84, 8, 2, 768, 384, 0.42),
    PublishedRun("119B", 80, 10240, 92, 8, 4, 1536, 768, 0.43),
    PublishedRun("177B", 96, 12288, 96, 8, 6, 2304, 1152, 0.44),
    PublishedRun("314B", 128, 16384, 96, 8, 8, 3072, 1536, 0.48),
    PublishedRun("462B", 144, 18432, 112, 8, 16, 6144, 3072, 0.47),
]

# Strong scaling: the 177B GPT-3 at a fixed batch of 1,152 on the chart's GPU counts. The
# README text gives 47% at 96 GPUs and 42% at 4,608; the 2,304-GPU point is the same
# configuration as the 177B weak-scaling row (44%). TP8/PP6 is assumed (not stated).
STRONG_SCALING = [
    PublishedRun("177B", 96, 12288, 96, 8, 6, gpus, 1152, mfu)
    for gpus, mfu in [(96, 0.47), (144, None), (288, None), (576, None), (1152, None),
                      (2304, 0.44), (3072, None), (4608, 0.42)]
]


MIXTRAL_TFLOPS = 468.0
# 64 GPUs, dropless, TP1 EP8 PP4 VP8, micro-batch 1, batch 256, seq 4096; the alltoall
# dispatcher and grouped GEMMs of the README's recipe; the distributed optimizer assumed.
MIXTRAL_LAYOUT = Layout(tp=1, pp=4, dp=16, ep=8, virtual_stages=8, moe_dispatcher="alltoall",
                        distributed_optimizer=True)
MIXTRAL_BATCH = 256


def predict_mixtral(curves: KernelCurves | None = None) -> Prediction:
    """The planner's prediction for Megatron-Core's Mixtral 8x7B point (MIXTRAL_TFLOPS)."""
    model = ModelConfig(**preset_values("mixtral-8x7b"))   # sequence 4096
    return predict(model, MIXTRAL_LAYOUT, CLUSTER, curves or load_curves(gpu_name=CLUSTER.gpu.name), MIXTRAL_BATCH,
                   SEQ_LENGTH, causal_flops=False)


def predict_run(run: PublishedRun, curves: KernelCurves) -> Prediction:
    """The planner's best layout for a published run, TP/PP/DP fixed as published."""
    # Megatron splits evenly; the runs had --tp-comm-overlap (Transformer Engine's).
    space = SearchSpace(tp=(run.tp,), pp=(run.pp,), cp=(1,), balance_pipeline=False, tp_comm_overlap=True)
    best = search(run.model(), run.gpus, CLUSTER, curves, run.global_batch_size, SEQ_LENGTH, space,
                  causal_flops=False, top=1)
    if not best:
        raise RuntimeError(f"no layout of the {run.label} run on {run.gpus} GPUs fits in memory")
    return best[0]


def reproduce(runs: list[PublishedRun], curves: KernelCurves | None = None) -> list[tuple[PublishedRun, Prediction]]:
    curves = curves or load_curves(gpu_name=CLUSTER.gpu.name)
    return [(run, predict_run(run, curves)) for run in runs]


def error_table(results: list[tuple[PublishedRun, Prediction]]) -> str:
    """Markdown table: published against predicted MFU, per point."""
    lines = ["| model | GPUs | layout chosen | published MFU | predicted MFU | error (points) | predicted TFLOP/s/GPU |",
             "|---|---|---|---|---|---|---|"]
    for run, prediction in results:
        published = f"{run.mfu * 100:.0f}%" if run.mfu is not None else "(chart only)"
        error = f"{(prediction.mfu - run.mfu) * 100:+.1f}" if run.mfu is not None else ""
        lines.append(f"| {run.label} | {run.gpus} | {prediction.layout.describe()} | {published} | "
                     f"{prediction.mfu * 100:.1f}% | {error} | {prediction.tflops_per_gpu:.0f} |")
    return "\n".join(lines)

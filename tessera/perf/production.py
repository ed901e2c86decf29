"""Megatron-LM's recommended production layouts, each beside the planner's own pick.

Source: Megatron-LM's parallelism guide (docs/user-guide/parallelism-guide.md, "Parallelism
Selection Guide": the language-model and mixture-of-experts tables; until May 2026 the guide
introduced them as "based on NVIDIA NeMo production setups"). It gives the model, the GPUs and
TP, PP, CP and EP, not the batch, the sequence or the rest of the layout. For each row:

- the planner's pick: `tessera plan --model M --gpus N --global-batch-size B` (everything searched);
- the production layout under the same planner: the same search with TP, PP, CP and EP held at
  the table's values (expert-TP, dispatcher, micro-batch, interleaving, the pipeline split,
  overlaps and, if nothing fits without it, recomputation chosen by the planner), and whether
  it fits in memory without recomputation.

The batch and sequence of each row, which the table leaves out, come from the public recipe
named beside them, or the planner's default batch where none is public.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessera.config import ModelConfig
from tessera.models.presets import preset_values
from tessera.perf.cluster import Cluster
from tessera.perf.kernels import KernelCurves
from tessera.perf.search import SearchSpace, default_global_batch_size, search
from tessera.perf.simulator import Prediction

# Megatron-LM's examples/llama/README.md: NVIDIA's LLaMA-3 recipes on H100s.
LLAMA_RECIPES = "Megatron-LM examples/llama/README.md"


@dataclass(frozen=True)
class ProductionLayout:
    label: str
    preset: str
    gpus: int
    tp: int
    pp: int
    cp: int
    ep: int
    seq_length: int
    global_batch_size: int
    batch_source: str     # where the batch and sequence come from

    def model(self) -> ModelConfig:
        return ModelConfig(**{**preset_values(self.preset), "seq_length": self.seq_length})


def _default_batch(label: str, preset: str, gpus: int, tp: int, pp: int, cp: int, ep: int,
                   seq_length: int) -> ProductionLayout:
    return ProductionLayout(label, preset, gpus, tp, pp, cp, ep, seq_length,
                            default_global_batch_size(gpus, seq_length), "the planner's default batch")


PRODUCTION_LAYOUTS = [
    ProductionLayout("LLaMA-3 8B", "llama3-8b", 8, 1, 1, 2, 1, 8192, 128, LLAMA_RECIPES),
    ProductionLayout("LLaMA-3 70B", "llama3-70b", 64, 4, 4, 2, 1, 8192, 128, LLAMA_RECIPES),
    # tessera's llama3-405b preset: LLaMA-3.1 405B's shapes (126 layers), trained at 8k.
    ProductionLayout("LLaMA-3.1 405B", "llama3-405b", 1024, 8, 8, 2, 1, 8192, 512, LLAMA_RECIPES),
    # The table's 128-512 GPUs, both ends; the batch of Narayanan et al. 2021 (arXiv:2104.04473).
    ProductionLayout("GPT-3 175B", "gpt3-175b", 128, 4, 8, 1, 1, 2048, 1536, "Narayanan et al. 2021"),
    ProductionLayout("GPT-3 175B", "gpt3-175b", 512, 4, 8, 1, 1, 2048, 1536, "Narayanan et al. 2021"),
    # Megatron-Core's MoE README: Mixtral 8x7B's H100 reference mapping runs batch 256 of 4096.
    ProductionLayout("Mixtral 8x7B", "mixtral-8x7b", 64, 1, 4, 1, 8, 4096, 256, "Megatron-Core MoE README"),
    _default_batch("Mixtral 8x22B", "mixtral-8x22b", 256, 4, 4, 1, 8, 4096),
    # DeepSeek-V3's report (arXiv:2412.19437) ramps the batch to 15,360 sequences of 4,096 on 2,048 GPUs;
    # 8,192 on 1,024 keeps its tokens per GPU near it.
    ProductionLayout("DeepSeek-V3 671B", "deepseek-v3", 1024, 2, 16, 1, 64, 4096, 8192, "DeepSeek-V3 report, scaled"),
]


@dataclass(frozen=True)
class Comparison:
    row: ProductionLayout
    pick: Prediction | None         # the planner's best layout (None: nothing fits)
    production: Prediction | None   # the best completion of the production layout (None: it cannot fit)

    @property
    def production_fits(self) -> str:
        """Whether the production layout fits: without recomputation, only with it, or not at all."""
        if self.production is None:
            return "no, even with full recompute"
        recompute = self.production.layout.recompute
        return "yes" if recompute == "none" else f"only with {recompute} recompute"


def compare(row: ProductionLayout, cluster: Cluster, curves: KernelCurves, space: SearchSpace) -> Comparison:
    """The planner's pick for the row's model, GPUs and batch, and the production layout's best
    completion, both searched in `space` (what `tessera plan` searches)."""
    model, batch, seq = row.model(), row.global_batch_size, row.seq_length
    pick = search(model, row.gpus, cluster, curves, batch, seq, space, top=1)
    fixed = replace(space, tp=(row.tp,), pp=(row.pp,), cp=(row.cp,), ep=(row.ep,))
    production = search(model, row.gpus, cluster, curves, batch, seq, fixed, top=1)
    return Comparison(row, pick[0] if pick else None, production[0] if production else None)


def comparison_table(comparisons: list[Comparison]) -> str:
    """Markdown: each production layout and the planner's pick, with their predicted tokens/s."""
    lines = ["| model | GPUs | batch x seq (source) | production TP/PP/CP/EP | its best completion | fits | "
             "tokens/s | planner's pick | tokens/s | pick / production |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        row = c.row
        production, production_speed = _cells(c.production)
        pick, pick_speed = _cells(c.pick)
        ratio = f"{c.pick.tokens_per_sec / c.production.tokens_per_sec:.2f}x" if c.pick and c.production else "-"
        lines.append(f"| {row.label} | {row.gpus} | {row.global_batch_size} x {row.seq_length} ({row.batch_source}) "
                     f"| {row.tp}/{row.pp}/{row.cp}/{row.ep} | {production} | {c.production_fits} | "
                     f"{production_speed} | {pick} | {pick_speed} | {ratio} |")
    return "\n".join(lines)


def _cells(prediction: Prediction | None) -> tuple[str, str]:
    if prediction is None:
        return "-", "-"
    return prediction.layout.describe(), f"{prediction.tokens_per_sec:,.0f}"

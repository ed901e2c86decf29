"""Uneven pipeline splits: the --decoder-first/last-pipeline-num-layers that make the slowest
pipeline rank as fast as it can be, from the simulator's per-layer times."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from tessera.config import ConfigError, ModelConfig
from tessera.perf.cluster import Cluster
from tessera.perf.kernels import KernelCurves
from tessera.perf.layout import Layout
from tessera.perf.simulator import StepModel, micro_batch_passes


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
    kinds = list(zip(model.moe_layers(), layout.fp8_layers(model.num_layers)))   # (MoE, FP8) of each layer

    def seconds(kind: tuple[bool, bool]) -> float:
        return sum(phase.total for phase in micro_batch_passes([steps.layer(layout, *kind)], layout.recompute, None))

    per_kind = {kind: seconds(kind) for kind in set(kinds)}
    layer_times = [per_kind[kind] for kind in kinds]   # dense and MoE layers differ, bf16 and FP8 ones
    layer = sum(layer_times) / len(layer_times)       # the unit of the splits tried
    output = sum(phase.total for phase in steps.output_layer(layout, model.padded_vocab_size(layout.tp)))
    even = model.num_layers // (layout.pp * layout.virtual_stages)
    reach = range(max(1, even - math.ceil(output / layer) - 1), even + math.ceil(output / layer) + 2)

    def cost(first: int | None, last: int | None) -> tuple[float, int]:
        """(slowest rank's time in layers, stages' distance from even): among equally fast
        splits the nearest to even, whose chunks stay alike under interleaving."""
        candidate = replace(layout, first_stage_layers=first, last_stage_layers=last)
        per_rank = candidate.rank_layers(model.num_layers)
        slowest = max(sum(layer_times[i] for i in layers) + (output if rank == layout.pp - 1 else 0.0)
                      for rank, layers in enumerate(per_rank))
        return round(slowest / layer, 6), sum(abs(size - even) for size in candidate.stage_layers(model.num_layers))

    options = {}
    for first, last in itertools.product([None, *reach], repeat=2):
        try:
            options[(first, last)] = cost(first, last)
        except ConfigError:   # the other stages cannot split the rest evenly
            continue
    if not options:   # no split near even works (the layout's own, if any, stands)
        return layout
    first, last = min(options, key=options.get)
    return replace(layout, first_stage_layers=first, last_stage_layers=last)

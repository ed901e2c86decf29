"""Uneven pipeline splits: the --decoder-first/last-pipeline-num-layers that make the slowest
pipeline rank as fast as it can be, from the simulator's per-layer times."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

from tessera.config import ConfigError
from tessera.parallel.pipeline_schedules import stage_layer_ranges
from tessera.perf.layout import Layout
from tessera.perf.simulator import StepModel, micro_batch_passes


def balance_pipeline(steps: StepModel, layout: Layout) -> Layout:
    """The layout with --decoder-first/last-pipeline-num-layers set so that the slowest
    pipeline rank is as fast as it can be (the even split if nothing beats it).

    The last rank also runs the output layer and the loss (about 2 layers' worth for a 50k
    vocabulary at h = 2048), so it usually gives layers to the first. Splits within a few
    layers of even are tried; the step time falls with the slowest rank's time, because the
    sum of all ranks' times (the fill and the drain) does not depend on the split.
    """
    if layout.pp == 1:
        return layout
    model, kinds = steps.model, steps.layer_kinds(layout)

    def seconds(kind: tuple[bool, bool]) -> float:
        return sum(phase.total for phase in micro_batch_passes([steps.layer(layout, *kind)], layout.recompute, None))

    per_kind = {kind: seconds(kind) for kind in set(kinds)}
    layer_times = [per_kind[kind] for kind in kinds]   # dense and MoE layers differ, bf16 and FP8 ones
    layer = sum(layer_times) / len(layer_times)       # the unit of the splits tried
    output = sum(phase.total for phase in steps.output_layer(layout, model.padded_vocab_size(layout.tp)))
    even = model.num_layers // (layout.pp * layout.virtual_stages)
    reach = range(max(1, even - math.ceil(output / layer) - 1), even + math.ceil(output / layer) + 2)

    prefix = list(itertools.accumulate(layer_times, initial=0.0))   # time of the layers before each

    def cost(first: int | None, last: int | None) -> tuple[float, int]:
        """(slowest rank's time in layers, stages' distance from even): among equally fast
        splits the nearest to even, whose chunks stay alike under interleaving."""
        stages = stage_layer_ranges(model.num_layers, layout.pp, layout.virtual_stages, first_stage_layers=first,
                                    last_stage_layers=last)
        per_rank = [0.0] * layout.pp
        for index, stage in enumerate(stages):   # stage c * pp + r is chunk c of rank r
            per_rank[index % layout.pp] += prefix[stage.stop] - prefix[stage.start]
        per_rank[-1] += output
        return round(max(per_rank) / layer, 6), sum(abs(len(stage) - even) for stage in stages)

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

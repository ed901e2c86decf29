"""Megatron's production layouts beside the planner's picks (tessera plan --production)."""

from tessera.perf.cluster import CLUSTERS
from tessera.perf.kernels import load_curves
from tessera.perf.production import PRODUCTION_LAYOUTS, compare, comparison_table
from tessera.perf.search import SearchSpace

SPACE = SearchSpace(framework="tessera", compiled=True)


def test_each_row_is_a_layout_of_its_gpus_and_the_pick_is_searched_around_it():
    for row in PRODUCTION_LAYOUTS:
        assert row.gpus % (row.tp * row.pp * row.cp) == 0 and row.model().num_attention_heads % row.tp == 0
    rows = [row for row in PRODUCTION_LAYOUTS if row.label in ("GPT-3 175B", "Mixtral 8x7B")]
    comparisons = [compare(row, CLUSTERS["dgx-h100"], load_curves(gpu_name="H100"), SPACE) for row in rows]
    for comparison in comparisons:
        row, production, pick = comparison.row, comparison.production.layout, comparison.pick.layout
        assert (production.tp, production.pp, production.cp, production.ep) == (row.tp, row.pp, row.cp, row.ep)
        assert production.gpus == pick.gpus == row.gpus
        # Both fit without recomputation, so the production layout was among the pick's candidates.
        assert comparison.production_fits == "yes" and pick.recompute == "none"
        assert comparison.pick.tokens_per_sec >= comparison.production.tokens_per_sec
    table = comparison_table(comparisons)
    assert len(table.splitlines()) == 2 + len(rows)
    for comparison in comparisons:
        assert f"{comparison.pick.tokens_per_sec:,.0f}" in table and comparison.production.layout.describe() in table

"""A hybrid stack of Mamba-2, Gated DeltaNet, attention, MLP and MoE layers trained under TP=2 + SP,
PP=2 (stages at the pattern's '|') and DP=2 against one process.

Same harness and tolerance as tests/dist/test_data_parallel.py (tests/dist/equivalence.py says
why). Under TP each rank holds half of the SSM heads and groups (in_proj cut per part, the conv,
dt_bias, A_log, D and the gated norm with them) and half of the Gated DeltaNet's key and value
heads (its norm weight, shared by the heads, on both); under SP the mixers see the whole sequence
between in_proj's all-gather and out_proj's reduce-scatter.
"""

import pytest

from tests.dist.equivalence import BASE, assert_equivalent, train, train_layouts
from tests.dist.launcher import run_distributed

HYBRID = ["--model", "tiny-hybrid", "--hybrid-layer-pattern", "M*E-|G*", "--num-experts", "4",
          "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--linear-num-key-heads", "2",
          "--linear-num-value-heads", "4", "--linear-key-head-dim", "16", "--linear-value-head-dim", "16"]
LAYOUTS = {
    "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP=2 at '|'": ["--pipeline-model-parallel-size", "2"],
    "DP=2": [],
}


@pytest.fixture(scope="module")
def reference():
    return train(HYBRID)


@pytest.fixture(scope="module")
def results():
    return run_distributed(train_layouts, 2, {name: HYBRID + flags for name, flags in LAYOUTS.items()})[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hybrid_layout_matches_single_process(reference, results, layout):
    assert_equivalent(reference, results[layout], layout)


def test_context_parallel_is_refused_in_one_line(capsys):
    from tessera.cli.args import parse_run_config

    with pytest.raises(SystemExit):
        parse_run_config(BASE + HYBRID + ["--context-parallel-size", "2"], "test", world_size=2)
    error = capsys.readouterr().err.strip()
    assert "--context-parallel-size > 1 with Mamba layers" in error and "\n" not in error

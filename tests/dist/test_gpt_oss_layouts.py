"""tiny-gpt-oss trained under TP=2 + SP, PP=2 and DP=2 against one process.

Learned sinks on every layer, a 7-token window on alternate layers (seq 64), biased experts
(top-2 of 4) with the clamped quick-GELU gate, a router bias, YaRN. Under TP each rank holds
its heads' sinks and the experts stay whole (expert biases need --expert-tensor-parallel-size 1,
as in Megatron); under SP attention sees the whole sequence, so the window is the same.
Same harness and tolerance as the other layouts (tests/dist/equivalence.py says why).
"""

import pytest

from tests.dist.equivalence import assert_equivalent, train, train_layouts
from tests.dist.launcher import run_distributed

GPT_OSS = ["--model", "tiny-gpt-oss"]
LAYOUTS = {
    "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"],
    "PP=2": ["--pipeline-model-parallel-size", "2"],
    "DP=2": [],
}


@pytest.fixture(scope="module")
def reference():
    return train(GPT_OSS)


@pytest.fixture(scope="module")
def results():
    return run_distributed(train_layouts, 2, {name: GPT_OSS + flags for name, flags in LAYOUTS.items()})[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_oss_layout_matches_single_process(reference, results, layout):
    assert_equivalent(reference, results[layout], layout)


def test_the_sinks_and_biases_train(reference):
    """The layouts above compare parameters that move: sinks and expert biases leave their start."""
    params = reference["params"]
    assert any(name.endswith("attention.sinks") for name in params)
    assert all(params[name].abs().max() > 0 for name in params if name.endswith(("fc1_bias", "fc2_bias")))

"""Activation and optimizer offload under pipeline parallelism: 1F1B over two stages and the
interleaved schedule over two stages of two chunks each, in two processes, give bit for bit the
losses, gradient norms and weights of the same layout without offload.

Under these schedules several micro-batches' and model chunks' groups are saved before the
first backward, and backward takes them in another order: each group must come back whole,
and its prefetch must fetch only what the same chunk's backward needs next. On the CPU the
host and the device are one memory (tests/training/test_offload_activations.py says what that
leaves unshown)."""

import pytest

from tests.dist import equivalence
from tests.dist.launcher import run_distributed

OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "core_attn", "attn_proj",
           "mlp", "--min-offloaded-tensor-size", "0", "--optimizer-cpu-offload", "--use-distributed-optimizer"]
LAYOUTS = {
    "PP=2": ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
    "PP=2 VPP=2": ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer"],
}


STEPS = ["--train-iters", "3"]   # eight micro-batches a step: each schedule's order, three times over


def train_both(layouts: dict[str, list[str]]) -> dict[str, tuple[dict, dict]]:
    return {name: (equivalence.train(flags + STEPS), equivalence.train(flags + STEPS + OFFLOAD))
            for name, flags in layouts.items()}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(train_both, 2, LAYOUTS)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_offload_under_pipelines_changes_no_bit(results, layout):
    plain, offloaded = results[layout]
    assert offloaded["loss"] == plain["loss"] and offloaded["grad_norm"] == plain["grad_norm"]
    assert plain["params"].keys() == offloaded["params"].keys()
    for name, tensor in plain["params"].items():
        assert offloaded["params"][name].equal(tensor), name

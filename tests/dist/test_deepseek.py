"""A tiny DeepSeek-V3-style model trained under expert, tensor (+SP), pipeline and data
parallelism with the distributed optimizer equals one process, and its checkpoints reshard.

tiny-deepseek with one MTP depth (weight 0.3): MLA with a query latent and YaRN, a dense first
layer then MoE (--moe-layer-freq list), sigmoid routing in groups with an expert bias (moved
fast, to matter in 5 steps) and a shared expert; the MTP depth is MoE like the last layer and
sits on the last pipeline stage, which keeps its own copy of the (untied) word embedding.

Each layout adds data parallelism (DP=2 or 4, one launch of four processes for all): the
losses, gradient norms, MoE and MTP losses at every step and the parameters after 5 steps
equal the single-process run's (tests/dist/equivalence.py says why rtol 1e-5). Checkpoints
saved at step 2 under one layout resume under another, and from four ranks in one process,
on the single-process curve.
"""

import os

import pytest
import torch

from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent, train
from tests.dist.launcher import run_distributed
from tests.dist.test_checkpoint import STOP, resume, save_at_stop

DEEPSEEK = ["--model", "tiny-deepseek", "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
            "--num-layers", "2", "--moe-layer-freq", "([0]*1+[1]*1)", "--moe-router-bias-update-rate", "1e-2",
            "--seq-length", "32", "--global-batch-size", "8"]
EP2 = ["--expert-model-parallel-size", "2"]
LAYOUTS = {   # four ranks each
    "EP=2 x TP=2 + SP": EP2 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "EP=2 x PP=2": EP2 + ["--pipeline-model-parallel-size", "2"],
    "EP=2 x DP=2, distributed optimizer": EP2 + ["--use-distributed-optimizer"],
}
RESHARD = [("EP=2 x TP=2 + SP", "EP=2 x PP=2"), ("EP=2 x PP=2", "EP=2 x DP=2, distributed optimizer")]
TO_ONE_PROCESS = "EP=2 x DP=2, distributed optimizer"


def _four_ranks(directory: str) -> dict:
    """Every layout, each resharding, and a checkpoint for one process to resume; by name."""
    out = {name: train(DEEPSEEK + flags) for name, flags in LAYOUTS.items()}
    for index, (saved, loaded) in enumerate(RESHARD):
        path = os.path.join(directory, str(index))
        out[f"{saved} -> {loaded}"] = save_at_stop(DEEPSEEK + LAYOUTS[saved], path) \
            + resume(DEEPSEEK + LAYOUTS[loaded], path)
    out["saved for one process"] = save_at_stop(DEEPSEEK + LAYOUTS[TO_ONE_PROCESS], os.path.join(directory, "one"))
    return out


@pytest.fixture(scope="module")
def reference():
    return train(DEEPSEEK)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek")
    out = run_distributed(_four_ranks, 4, str(directory))[-1]
    out["one process"] = out.pop("saved for one process") + resume(DEEPSEEK, str(directory / "one"))
    return out


def test_the_model_is_deepseek_shaped(reference):
    """What the layouts below check is there: MLA latents, a MoE MTP depth whose expert bias moved, MTP losses."""
    params = reference["params"]
    assert {"mtp.layers.0.layer.attention.q_down.weight", "layers.0.attention.kv_down.weight"} <= params.keys()
    assert "layers.0.mlp.fc1.weight" in params and "mtp.layers.0.layer.mlp.shared_expert.fc1.weight" in params
    assert params["mtp.layers.0.layer.mlp.router.expert_bias"].abs().max() > 0
    assert all(r["mtp_1 loss"] > 0 for r in reference["terms"]) and len(reference["loss"]) == equivalence.STEPS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_layout_matches_single_process(reference, results, layout):
    assert_equivalent(reference, results[layout], layout)


@pytest.mark.parametrize("change", [f"{saved} -> {loaded}" for saved, loaded in RESHARD] + ["one process"])
def test_checkpoint_reshards_onto_the_single_process_curve(reference, results, change):
    assert len(results[change]) == equivalence.STEPS, f"saved at {STOP}, resumed to the end"
    torch.testing.assert_close(results[change], reference["loss"], rtol=1e-5, atol=0)

"""A MoE model trained under expert, tensor, data and pipeline parallelism against one process.

tiny-moe: 4 layers, the first dense; 4 experts, top-2, a shared expert; load-balancing
losses on (per micro-batch and per sequence) with a z-loss, grouped GEMMs. Every layout
must give the single-process losses, gradient norms, MoE losses and load imbalance at
every step and the same parameters after the steps (tests/dist/equivalence.py says why
these tolerances); a checkpoint saved at EP=2 resumes on the single-process curve at EP=1.
"""

import pytest
import torch

from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent, train
from tests.dist.launcher import run_distributed
from tests.dist.test_checkpoint import STOP, resume, save_at_stop

MOE = ["--model", "tiny-moe", "--moe-grouped-gemm", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "1e-3", "--moe-z-loss-coeff", "1e-3"]
# Aux-loss-free balancing: sigmoid scores, a bias moved once per step (fast, to matter in 5 steps).
BIAS = MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
              "--moe-router-bias-update-rate", "1e-2"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EP2, EP4 = ["--expert-model-parallel-size", "2"], ["--expert-model-parallel-size", "4"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]

LAYOUTS = {   # name: (model flags, layout flags, world size)
    "EP=2": (MOE, EP2, 2),
    "EP=2 alltoall": (MOE, EP2 + ALLTOALL, 2),
    "ETP=1 with TP=2 + SP, EP=2": (MOE, SP + ["--expert-tensor-parallel-size", "1"] + EP2, 2),
    "ETP=1 with TP=2 + SP, experts replicated": (MOE, SP + ["--expert-tensor-parallel-size", "1"], 2),
    "expert bias at EP=2": (BIAS, EP2 + ALLTOALL, 2),
    "EP=4": (MOE, EP4 + ALLTOALL, 4),
    "EP=2 x TP=2 + SP": (MOE, SP + EP2, 4),
    "EP=2 x TP=2 + SP alltoall": (MOE, SP + EP2 + ALLTOALL, 4),
    "EP=2 x DP=2, distributed optimizer": (MOE, EP2 + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                       "--ddp-bucket-size", "20000"], 4),
    "EP=2 x PP=2": (MOE, EP2 + ["--pipeline-model-parallel-size", "2"], 4),
    "EP=2 x FSDP2 DP=4": (MOE, EP2 + ["--use-torch-fsdp2"], 4),
}


def _train_all(layouts: dict[str, list[str]]) -> dict[str, dict]:
    return {name: train(flags) for name, flags in layouts.items()}


@pytest.fixture(scope="module")
def references():
    return {"moe": train(MOE), "bias": train(BIAS)}


@pytest.fixture(scope="module")
def results():
    out = {}
    for world in (2, 4):
        layouts = {name: model + layout for name, (model, layout, size) in LAYOUTS.items() if size == world}
        out.update(run_distributed(_train_all, world, layouts)[0])
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layout_matches_single_process(references, results, layout):
    reference = references["bias" if LAYOUTS[layout][0] is BIAS else "moe"]
    assert_equivalent(reference, results[layout], layout)


def test_the_expert_bias_moves_in_steps_of_the_rate(references):
    """The bias layout above tests something: each step moves each bias by +-rate (or 0 at the mean)."""
    biases = [t for name, t in references["bias"]["params"].items() if name.endswith("expert_bias")]
    assert len(biases) == 3 and all(b.abs().max() > 0 for b in biases)
    steps = torch.stack(biases) / 1e-2
    assert (steps - steps.round()).abs().max() < 1e-4 and steps.abs().max() <= equivalence.STEPS


def test_checkpoint_saved_at_ep2_resumes_at_ep1_on_the_single_process_curve(tmp_path, references):
    before = run_distributed(save_at_stop, 2, MOE + EP2 + ALLTOALL, str(tmp_path))[-1]
    after = resume(MOE, str(tmp_path))
    expected = references["moe"]["loss"]
    assert len(before) == STOP and len(after) == equivalence.STEPS - STOP
    torch.testing.assert_close(before + after, expected, rtol=1e-5, atol=0)


def test_checkpoint_saved_at_ep1_resumes_at_ep2(tmp_path, references):
    before = save_at_stop(MOE, str(tmp_path))
    after = run_distributed(resume, 2, MOE + EP2, str(tmp_path))[-1]
    torch.testing.assert_close(before + after, references["moe"]["loss"], rtol=1e-5, atol=0)

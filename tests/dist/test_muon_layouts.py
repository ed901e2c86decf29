"""--optimizer muon under parallel layouts against one process: data parallelism (DDP, and the
distributed optimizer, where each rank steps whole matrices), tensor + sequence parallelism
(matrices gathered over TP), pipeline parallelism, MoE experts dealt over expert data
parallelism; and a distributed-Muon checkpoint that resumes exactly.

Newton-Schulz runs in fp32 here (--muon-fp32-matmul-prec highest): in bf16, a layout's last-ulp
difference in a gradient can round a bf16 input the other way, and the test would measure bf16's
resolution rather than the layout. Tolerances otherwise as tests/dist/equivalence.py."""

import pytest

from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent
from tests.dist.launcher import run_distributed

MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "highest", "--muon-nesterov", "--weight-decay", "0.1",
        "--muon-extra-scale-factor", "0.2"]
MOE = ["--model", "tiny-moe", "--num-layers", "2", "--moe-layer-freq", "1"]
LAYOUTS = {
    "DP=2 DDP": [],
    "DP=2 distributed optimizer": ["--use-distributed-optimizer"],
    "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP=2": ["--pipeline-model-parallel-size", "2"],
}
MOE_LAYOUTS = {
    "MoE EP=2 distributed optimizer": MOE + ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
    "MoE expert TP=2 distributed optimizer": MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                    "--use-distributed-optimizer"],
}


def train(flags: list[str]) -> dict:
    return equivalence.train(MUON + flags)


def train_all(layouts: dict[str, list[str]], checkpoint: str) -> dict[str, dict]:
    """Every layout; then the distributed optimizer's run again, saved after 3 steps and resumed."""
    results = {name: train(flags) for name, flags in layouts.items()}
    dp = ["--use-distributed-optimizer", "--save", checkpoint]
    first = train(dp + ["--exit-interval", "3"])
    resumed = train(dp + ["--load", checkpoint])
    results["DP=2 distributed optimizer, resumed"] = dict(resumed, loss=first["loss"] + resumed["loss"],
                                                            grad_norm=first["grad_norm"] + resumed["grad_norm"],
                                                            moe=first["moe"] + resumed["moe"],
                                                            terms=first["terms"] + resumed["terms"])
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    layouts = {**LAYOUTS, **MOE_LAYOUTS}
    return run_distributed(train_all, 2, layouts, str(tmp_path_factory.mktemp("muon")))[0]


def test_muon_layouts_match_one_process(results):
    reference, moe_reference = train([]), train(MOE)
    for name, result in results.items():
        assert_equivalent(moe_reference if name.startswith("MoE") else reference, result, name)

"""Pipeline parallelism, alone and with TP and DP, against single-process training.

Same harness and tolerance as tests/dist/test_data_parallel.py (tests/dist/equivalence.py
says why): loss and grad norm every step at rtol 1e-5, every parameter at the end by
relative norm 1e-5, plus the validation loss after training. Every layout runs at least
4 micro-batches per step (global batch 16 of micro-batches of 2, over DP ranks), 4 layers.
Layouts of one world size share one spawned run. Each --overlap-p2p-communication layout is
also compared with its twin without the flag (OVERLAPPED).
"""

import pytest
import torch.distributed as dist

from tests.dist.equivalence import BASE, assert_equivalent, result
from tests.dist.launcher import run_distributed

LLAMA = ["--num-layers", "4"]                       # tiny-llama: RoPE, untied output layer
# Learned positions, tied word embedding. No linear biases: the key bias has a zero gradient
# in exact arithmetic (softmax ignores a constant per query), so its computed gradient is
# rounding noise that Adam scales up to full-size updates, differing between any two layouts.
GPT = ["--model", "tiny-gpt", "--num-layers", "4", "--disable-bias-linear"]
EVAL = ["--eval-interval", "1000", "--eval-iters", "1"]

LAYOUTS = {
    2: {
        "PP=2": (LLAMA, ["--pipeline-model-parallel-size", "2"]),
        "PP=2 gpipe": (LLAMA, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"]),
        "PP=2 x 2 virtual stages": (LLAMA, ["--pipeline-model-parallel-size", "2",
                                            "--virtual-pipeline-model-parallel-size", "2"]),
        "PP=2 uneven 1 + 3 layers": (LLAMA, ["--pipeline-model-parallel-size", "2",
                                             "--decoder-first-pipeline-num-layers", "1",
                                             "--decoder-last-pipeline-num-layers", "3"]),
        "PP=2 tied embeddings": (GPT, ["--pipeline-model-parallel-size", "2"]),
        "PP=2 overlap p2p": (LLAMA, ["--pipeline-model-parallel-size", "2", "--overlap-p2p-communication"]),
        "PP=2 x 2 virtual stages overlap p2p": (LLAMA, ["--pipeline-model-parallel-size", "2",
                                                        "--virtual-pipeline-model-parallel-size", "2",
                                                        "--overlap-p2p-communication"]),
    },
    4: {
        "PP=4 recompute": (LLAMA, ["--pipeline-model-parallel-size", "4", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
        "TP=2 x PP=2 SP": (LLAMA, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                   "--sequence-parallel"]),
        "TP=2 x PP=2 SP, both overlaps": (LLAMA, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                                                  "2", "--sequence-parallel", "--tp-comm-overlap",
                                                  "--overlap-p2p-communication"]),
        "PP=2 x DP=2 overlap": (LLAMA, ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce",
                                        "--ddp-bucket-size", "20000"]),
        "PP=2 x DP=2 overlap, overlap p2p": (LLAMA, ["--pipeline-model-parallel-size", "2", "--overlap-grad-reduce",
                                                     "--ddp-bucket-size", "20000", "--overlap-p2p-communication"]),
        "PP=2 x 2 virtual x DP=2 tied, distributed optimizer, overlap": (
            GPT, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                  "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000"]),
    },
    8: {
        "TP=2 x PP=2 x DP=2": (LLAMA, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                                       "--sequence-parallel", "--use-distributed-optimizer"]),
    },
}
OVERLAPPED = {"PP=2 overlap p2p": "PP=2", "PP=2 x 2 virtual stages overlap p2p": "PP=2 x 2 virtual stages",
              "PP=2 x DP=2 overlap, overlap p2p": "PP=2 x DP=2 overlap",
              "TP=2 x PP=2 SP, both overlaps": "TP=2 x PP=2 SP"}


def _train(flags: list[str]) -> dict:
    from tessera.cli.args import parse_run_config
    from tessera.training.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    config, _ = parse_run_config(BASE + EVAL + flags, "test", world_size=world)
    trainer = Trainer(config)
    return {**result(trainer, trainer.train()), "eval": trainer.evaluate()}


def _train_layouts(layouts: dict) -> dict:
    return {name: _train(model + flags) for name, (model, flags) in layouts.items()}


@pytest.fixture(scope="module")
def references():
    return {"llama": _train(LLAMA), "gpt": _train(GPT)}


@pytest.fixture(scope="module")
def results():
    out = {}
    for world_size, layouts in LAYOUTS.items():
        out.update(run_distributed(_train_layouts, world_size, layouts)[0])
    return out


@pytest.mark.parametrize("layout", [name for layouts in LAYOUTS.values() for name in layouts])
def test_pipeline_layout_matches_single_process(references, results, layout):
    model = next(layouts[layout][0] for layouts in LAYOUTS.values() if layout in layouts)
    reference = references["gpt" if model is GPT else "llama"]
    assert_equivalent(reference, results[layout], layout)
    assert results[layout]["eval"] == pytest.approx(reference["eval"], rel=1e-5), f"{layout}: validation loss"


@pytest.mark.parametrize("layout", OVERLAPPED)
def test_overlapped_p2p_matches_the_same_layout_without_it(results, layout):
    assert_equivalent(results[OVERLAPPED[layout]], results[layout], layout)
    assert results[layout]["eval"] == pytest.approx(results[OVERLAPPED[layout]]["eval"], rel=1e-5), layout


def test_stage_layer_ranges():
    from tessera.config import ConfigError
    from tessera.parallel.pipeline_schedules import stage_layer_ranges

    assert stage_layer_ranges(8, 2) == [range(0, 4), range(4, 8)]
    assert stage_layer_ranges(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_ranges(10, 4, first_stage_layers=1, last_stage_layers=3) == [
        range(0, 1), range(1, 4), range(4, 7), range(7, 10)]
    with pytest.raises(ConfigError, match="--decoder-first-pipeline-num-layers"):
        stage_layer_ranges(8, 4, first_stage_layers=3)

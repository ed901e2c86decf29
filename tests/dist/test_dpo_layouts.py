"""tessera train --dpo: the loss is log 2 where the policy is its reference, it learns to prefer the
chosen answers, a resume is exact, and data, tensor + sequence, pipeline and context parallelism
(with the precomputed reference and with LoRA's adapters-off one) give one process's losses and
weights."""

import json
import math
import random

import pytest

from tessera.cli.args import parse_run_config
from tessera.training.trainer import Trainer
from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent
from tests.dist.launcher import run_distributed

# Byte-level tokens, the identity prompt format: no tokenizer files. The vocabulary pads alike at TP=1 and 2.
DPO = ["--model", "tiny-llama", "--dpo", "--dpo-beta", "0.5", "--sft-tokenizer-prompt-format", "identity",
       "--tokenizer-type", "ByteTokenizer", "--vocab-size", "272", "--split", "1", "--lr", "3e-3",
       "--lr-warmup-iters", "1", "--train-iters", "3", "--micro-batch-size", "2", "--global-batch-size", "8",
       "--log-interval", "1000", "--num-workers", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
       "--seed", "11"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
WORDS = "yes no maybe always never red green blue".split()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    rng = random.Random(0)
    rows = [{"prompt": " ".join(rng.choices(WORDS, k=3)) + "?", "chosen": " ".join(rng.choices(WORDS[:4], k=2)),
             "rejected": " ".join(rng.choices(WORDS[4:], k=rng.randint(1, 3)))} for _ in range(32)]
    path = tmp_path_factory.mktemp("dpo") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["--data-path", str(path)]


def trainer(flags: list[str]) -> Trainer:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    return Trainer(parse_run_config(DPO + flags, "test", world_size=world)[0])


def train(flags: list[str]) -> dict:
    run = trainer(flags)
    return equivalence.result(run, run.train())


def train_layouts(data: list[str], layouts: dict[str, list[str]]) -> dict[str, dict]:
    return {name: train(data + flags) for name, flags in layouts.items()}


@pytest.mark.parametrize("flags", [[], LORA], ids=["precomputed reference", "LoRA: adapters off"])
def test_dpo_starts_at_log_2_and_learns_the_preference(data, flags):
    history = trainer(data + flags + ["--train-iters", "12", "--lr", "1e-2"]).train()
    assert history[0].loss == pytest.approx(math.log(2), rel=1e-5)   # the policy is its reference
    assert history[0].terms["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert history[-1].terms["rewards/margins"] > 0 and history[-1].loss < math.log(2)


def test_a_dpo_resume_is_exact(data, tmp_path):
    start = tmp_path / "start"
    trainer(data + ["--train-iters", "1", "--lr", "0", "--save", str(start)]).train()
    flags = data + ["--pretrained-checkpoint", str(start), "--train-iters", "4"]
    uninterrupted = [r.loss for r in trainer(flags).train()]
    resume = ["--save", str(tmp_path / "out"), "--load", str(tmp_path / "out")]
    first = trainer(flags + resume + ["--exit-interval", "2"]).train()
    second = trainer(flags + resume).train()
    assert [r.loss for r in first + second] == pytest.approx(uninterrupted, rel=1e-6)


def test_dpo_layouts_match_one_process(data):
    pp, cp = ["--pipeline-model-parallel-size", "2"], ["--context-parallel-size", "2"]
    layouts = {"DP=2": [], "TP=2 + SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "PP=2": pp, "CP=2": cp,
               "LoRA DP=2 distributed optimizer": LORA + ["--use-distributed-optimizer"],
               "LoRA TP=2 + SP": LORA + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "LoRA PP=2": LORA + pp, "LoRA CP=2": LORA + cp}
    references = {flags: train(data + list(flags)) for flags in ((), tuple(LORA))}
    results = run_distributed(train_layouts, 2, data, layouts)[0]
    for name, result in results.items():
        # A reward is beta x a difference of log-probs summed over ~60 tokens (|logp| ~ 60): the
        # summation order of CP's chunks moves it by float32's rounding of those sums, ~1e-6.
        assert_equivalent(references[tuple(LORA) if name.startswith("LoRA") else ()], result, name,
                          terms_atol=1e-5)

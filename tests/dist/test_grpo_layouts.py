"""tessera train --grpo under data, tensor and pipeline parallelism (2 gloo processes) equals one
process: the engine samples the same answers from each layout's shards (under PP from the whole
model gathered from the stages), and the losses, gradient norms, rollout metrics and weights after
three steps agree (the third trains a second batch of answers).

The GRPO loss starts near 0 (the advantages of a group sum to 0): it is compared to 1e-6
absolute; the weights and gradient norms as every layout is (tests/dist/equivalence.py). Layouts:
DP=2, TP=2, the KL to a frozen copy under DP=2 with the distributed optimizer, the KL to
LoRA's adapters-off base under TP=2, a MoE model replaying the rollout's routing with the KL
to a frozen copy under DP=2; and PP=2 (pi_old, --grpo-iterations 2, and the reference through the
forward-only schedule): alone, with virtual stages, with the KL to a frozen copy of the stages,
with the KL to LoRA's base and the engine freed after each rollout, a hybrid (Mamba-2) model
cut 3 + 2 layers, and a MoE model with the KL to a frozen copy."""

import json
import random

import pytest
import torch

from tests.dist import equivalence
from tests.dist.equivalence import assert_equivalent
from tests.dist.launcher import run_distributed
from tests.posttrain.test_grpo_rollout import GRPO
from tests.posttrain.test_router_replay import MOE

# Timings and the engine's distance from the trainer differ by layout; everything else must not.
UNCOMPARED = ("rollout_seconds", "train_seconds", "logprob_gap")
STEPS = ["--train-iters", "3", "--grpo-iterations", "2", "--lr", "3e-3", "--grpo-temperature", "2"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]
KL = ["--grpo-kl-coeff", "0.1"]
HYBRID = ["--model", "tiny-hybrid", "--vocab-size", "272", "--seq-length", "24"]
FOUR_LAYERS = ["--num-layers", "4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    rng = random.Random(1)
    rows = [{"prompt": f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=", "answer": rng.randint(0, 18)}
            for _ in range(16)]
    path = tmp_path_factory.mktemp("grpo") / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ["--data-path", str(path), "--grpo-reward", "format", "--grpo-format-regex", "[0-9a-z]"]


def train(flags: list[str]) -> dict:
    from tessera.cli.args import parse_run_config
    from tessera.training.trainer import Trainer
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    run = Trainer(parse_run_config(GRPO + STEPS + flags, "test", world_size=world)[0])
    result = equivalence.result(run, run.train())
    result["terms"] = [{k: v for k, v in terms.items() if k not in UNCOMPARED} for terms in result["terms"]]
    return result


def train_layouts(data: list[str], layouts: dict[str, list[str]]) -> dict[str, dict]:
    return {name: train(data + flags) for name, flags in layouts.items()}


def test_grpo_layouts_match_one_process(data):
    tp, pp = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
    replay = KL + MOE + ["--moe-enable-routing-replay"]
    virtual = ["--num-layers-per-virtual-pipeline-stage", "1"]
    freed = ["--rl-kv-cache-management-mode", "recompute"]
    # layout: (its flags, the one-process run's)
    layouts = {"DP=2": ([], []), "TP=2": (tp, []),
               "KL frozen copy DP=2 distributed optimizer": (KL + ["--use-distributed-optimizer"], KL),
               "KL LoRA TP=2": (KL + LORA + tp, KL + LORA), "MoE router replay KL frozen copy DP=2": (replay, replay),
               "PP=2": (pp, []), "PP=2 virtual stages": (FOUR_LAYERS + pp + virtual, FOUR_LAYERS),
               "KL frozen copy PP=2": (KL + pp, KL), "KL LoRA PP=2 engine freed": (KL + LORA + pp + freed, KL + LORA),
               "hybrid PP=2": (HYBRID + pp + ["--decoder-first-pipeline-num-layers", "3"], HYBRID),
               "MoE KL frozen copy PP=2": (KL + MOE + pp, KL + MOE)}
    references = {tuple(flags): train(data + flags) for _, flags in layouts.values()}
    results = run_distributed(train_layouts, 2, data, {name: flags for name, (flags, _) in layouts.items()})[0]
    for name, result in results.items():
        reference = references[tuple(layouts[name][1])]
        assert any(terms["reward_std"] > 0 for terms in reference["terms"])   # the answers teach something
        torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: loss differs\n{m}")
        # LoRA's B starts at 0: three Adam steps later it is made of the few first updates, where
        # Adam's 1 / sqrt(v) magnifies the TP all-reduce's rounding most (~1.1e-5 measured).
        assert_equivalent(reference, {**result, "loss": reference["loss"]}, name, terms_atol=1e-6,
                          params_rtol=3e-5 if "LoRA" in name else 1e-5)

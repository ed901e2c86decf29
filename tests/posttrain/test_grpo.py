"""GRPO's advantages and loss against the paper's formulas written out by hand, and against TRL's
GRPOTrainer._compute_loss (trl/trainer/grpo_trainer.py) run on the same per-token log-probs;
the loss's normalisation under any micro-batch split; the update with one answer per group, no
clip and no KL is REINFORCE's.

The TRL oracle: `_compute_loss` is called as TRL defines it, on a stand-in for the trainer that
holds only the settings it reads (loss type, epsilons, beta, one process, no accumulation) and
returns our log-probs as the model's. fp32 throughout.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tessera.config import PostTrainConfig
from tessera.posttrain.grpo import (
    ADVANTAGES, OLD_LOG_PROBS, REFERENCE_LOG_PROBS, GRPOObjective, group_advantages,
)

EPS = 0.2
MAX_NEW = 6


def test_group_advantages_equal_a_hand_written_reference():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, 1.0, 0.0, 3.0]
    expected = []
    for group in (rewards[0:4], rewards[4:8], rewards[8:12]):
        mean, std = statistics.mean(group), statistics.stdev(group)   # the sample std, as TRL's nanstd
        expected += [(r - mean) / (std + 1e-4) for r in group]
    actual = group_advantages(torch.tensor(rewards, dtype=torch.float64), 4)
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert group_advantages(torch.tensor(rewards), 1).tolist() == rewards   # no group: REINFORCE


def fixed_samples(rows: int = 4, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Answers of different lengths after prompts of different lengths, pi != pi_old != pi_ref,
    ratios on both sides of the clip and advantages of both signs."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq)
    for row, (start, length) in enumerate([(1, 6), (2, 3), (0, 5), (3, 2)][:rows]):
        mask[row, start:start + length] = 1
    log_probs = -torch.rand(rows, seq, generator=generator) * 3
    return {"log_probs": log_probs, "loss_mask": mask,
            OLD_LOG_PROBS: log_probs + 0.4 * torch.randn(rows, seq, generator=generator),
            REFERENCE_LOG_PROBS: log_probs + 0.3 * torch.randn(rows, seq, generator=generator),
            ADVANTAGES: torch.tensor([1.5, -0.7, 0.3, -1.1])[:rows]}


def hand_written_loss(samples: dict, loss_type: str, beta: float) -> float:
    """DeepSeekMath (arXiv 2402.03300) eq. 3 with KL eq. 4, token by token, and the three sums."""
    per_answer, total, tokens = [], 0.0, 0
    for i in range(samples["loss_mask"].shape[0]):
        answer = []
        for t in range(samples["loss_mask"].shape[1]):
            if not samples["loss_mask"][i, t]:
                continue
            logp, old = samples["log_probs"][i, t].item(), samples[OLD_LOG_PROBS][i, t].item()
            ref, advantage = samples[REFERENCE_LOG_PROBS][i, t].item(), samples[ADVANTAGES][i].item()
            ratio = math.exp(logp - old)
            surrogate = min(ratio * advantage, min(max(ratio, 1 - EPS), 1 + EPS) * advantage)
            kl = math.exp(ref - logp) - (ref - logp) - 1
            answer.append(-surrogate + beta * kl)
        per_answer.append(sum(answer) / len(answer))
        total, tokens = total + sum(answer), tokens + len(answer)
    answers = len(per_answer)
    return {"grpo": sum(per_answer) / answers, "dapo": total / tokens, "dr_grpo": total / (answers * MAX_NEW)}[loss_type]


def objective(loss_type: str, beta: float) -> GRPOObjective:
    config = PostTrainConfig(grpo=True, grpo_loss_type=loss_type, grpo_clip_eps=EPS, grpo_kl_coeff=beta,
                             grpo_max_new_tokens=MAX_NEW)
    return GRPOObjective(config, rollout_metrics=dict)


def run_objective(samples: dict, loss_type: str, beta: float, split: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The loss, its gradient w.r.t. the log-probs and the metrics, the rows cut into micro-batches of `split`."""
    log_probs = samples["log_probs"].clone().requires_grad_()
    terms = objective(loss_type, beta)
    batches = [{key: value[i:i + split] for key, value in samples.items() if key != "log_probs"}
               for i in range(0, log_probs.shape[0], split)]
    terms.begin()
    normaliser = terms.normaliser(batches)
    for i, batch in zip(range(0, log_probs.shape[0], split), batches):
        (terms.micro_batch(-log_probs[i:i + split], batch) / normaliser).backward()
    loss, metrics = terms.finish(normaliser)
    return loss, log_probs.grad, metrics


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_loss_equals_the_papers_formula_for_any_micro_batch_split(loss_type):
    samples = fixed_samples()
    expected = hand_written_loss(samples, loss_type, beta=0.05)
    whole, whole_grad, _ = run_objective(samples, loss_type, 0.05, split=4)
    halves, halves_grad, _ = run_objective(samples, loss_type, 0.05, split=2)
    assert whole.item() == pytest.approx(expected, rel=1e-6)
    assert halves.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(halves_grad, whole_grad, rtol=1e-6, atol=1e-9)


class _Accelerator:
    num_processes = 1

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather

    @staticmethod
    def reduce(tensor, reduction):
        return tensor


def trl_loss(samples: dict, loss_type: str, beta: float) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """TRL's GRPOTrainer._compute_loss on the samples: its loss, the gradient and its metrics."""
    from trl import GRPOTrainer

    mask = samples["loss_mask"]
    log_probs = samples["log_probs"].clone().requires_grad_()
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (log_probs, torch.zeros_like(log_probs), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=EPS, epsilon_high=EPS, use_vllm=False,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None), aux_loss_enabled=False,
        _entropy_bonus_enabled=False, model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW, accelerator=_Accelerator(), _metrics={"train": defaultdict(list)})
    stand_in.args.steps_per_generation = 1
    inputs = {"prompt_ids": torch.zeros(mask.shape[0], 0, dtype=torch.long),
              "prompt_mask": torch.zeros(mask.shape[0], 0, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask,
              "advantages": samples[ADVANTAGES], "old_per_token_logps": samples[OLD_LOG_PROBS],
              "ref_per_token_logps": samples[REFERENCE_LOG_PROBS], "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss, log_probs.grad, stand_in._metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_the_loss_equals_trls(loss_type):
    samples = fixed_samples(seed=3)
    expected_loss, expected_grad, trl_metrics = trl_loss(samples, loss_type, beta=0.04)
    loss, grad, metrics = run_objective(samples, loss_type, 0.04, split=2)
    assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert metrics["kl"].item() == pytest.approx(trl_metrics["kl"][0], rel=1e-6)
    assert metrics["clip_ratio"].item() == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], rel=1e-6)
    assert 0 < metrics["clip_ratio"].item() < 1   # the fixed samples do clip, on some tokens

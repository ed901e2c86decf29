"""Group relative policy optimisation (GRPO): advantages, the clipped objective and its metrics.

GRPO (Shao et al. 2024, "DeepSeekMath", https://arxiv.org/abs/2402.03300, section 4.1) samples
G answers o_1..o_G to each prompt q from the policy pi_old, rewards each (r_i), and trains the
policy on

    A_i     = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)       the same for every token of o_i
    ratio   = pi(o_i,t | q, o_i,<t) / pi_old(o_i,t | q, o_i,<t)
    l_i,t   = -min(ratio A_i, clip(ratio, 1 - eps, 1 + eps) A_i) + beta KL_i,t
    KL_i,t  = pi_ref / pi - log(pi_ref / pi) - 1                    (the paper's eq. 4, Schulman's k3)

The std is the group's sample standard deviation (Bessel's correction) and 1e-4 keeps a group
of equal rewards at advantage 0: TRL's GRPOTrainer (trl/trainer/grpo_trainer.py,
`_generate_and_score_completions`, scale_rewards="group"). A group of one answer has no
baseline: its advantage is its reward, and the objective is REINFORCE's (Williams 1992).

How the token losses l_i,t add up is `--grpo-loss-type`, by the names of TRL's `loss_type`
(`_compute_loss`), over the whole global batch (every micro-batch and data-parallel rank):

    grpo     mean over answers of (mean over the answer's tokens)      the paper's eq. 3 [default]
    dapo     sum over all answer tokens / their number                  TRL's default; NeMo RL's
                                                                        token_level_loss (arXiv 2503.14476)
    dr_grpo  sum over all answer tokens / (answers x max new tokens)    arXiv 2503.20783

TRL's grpo and dr_grpo average each micro-batch and divide by the accumulation steps, the
same thing when the micro-batches are equal in size (they are here). Log-probabilities are
those of the model's own distribution (temperature 1), as Megatron-LM's and NeMo RL's; TRL
divides the logits by the sampling temperature first (equal at --grpo-temperature 1).

pi_old: with one optimizer step per batch of answers (--grpo-iterations 1) the policy is
pi_old during that step, so its log-probs are the step's own, detached, as in TRL; with
more, the rollout computes them before the first step with the trainer's own forward pass
(tessera.posttrain.grpo_rollout), so the ratio is exactly 1 on the first step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

ADVANTAGE_EPS = 1e-4
# What the rollout adds to each micro-batch beside tokens, labels and loss_mask.
ADVANTAGES = "advantages"                      # [rows]
OLD_LOG_PROBS = "old_log_probs"                # [rows, seq]: pi_old's, with --grpo-iterations > 1
REFERENCE_LOG_PROBS = "reference_log_probs"    # [rows, seq]: the reference's, with --grpo-kl-coeff > 0
ENGINE_LOG_PROBS = "engine_log_probs"          # [rows, seq]: the engine's, on a batch's first step


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each answer's advantage [answers] from the rewards of consecutive groups of `group_size`."""
    if group_size == 1:
        return rewards.clone()
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return advantages.view(-1)


def grpo_token_losses(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      clip_eps: float, reference_log_probs: torch.Tensor | None = None, kl_coeff: float = 0.0
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token [rows, seq]: the loss l_i,t, the KL estimate (detached; zeros without a
    reference) and whether the clip took the gradient away (TRL's clip_ratio/region_mean)."""
    advantages = advantages[:, None].to(log_probs.dtype)
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    losses = -torch.min(ratio * advantages, clipped * advantages)
    kl = torch.zeros_like(log_probs)
    if reference_log_probs is not None:
        difference = reference_log_probs - log_probs
        kl = torch.exp(difference) - difference - 1
        losses = losses + kl_coeff * kl
    region = ((ratio < 1 - clip_eps) & (advantages < 0)) | ((ratio > 1 + clip_eps) & (advantages > 0))
    return losses, kl.detach(), region


def aggregate(losses: torch.Tensor, mask: torch.Tensor, loss_type: str, *, answers: torch.Tensor,
              tokens: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the global batch's loss: `answers` and `tokens` are the
    global batch's (all micro-batches and data-parallel ranks)."""
    masked = losses * mask
    if loss_type == "grpo":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum() / answers
    if loss_type == "dapo":
        return masked.sum() / tokens
    if loss_type == "dr_grpo":
        return masked.sum() / (answers * max_new_tokens)
    raise ValueError(f"unknown GRPO loss type {loss_type!r}")


class GRPOObjective:
    """GRPO as the trainer's objective, with the interface of tessera.training.losses.LossTerms:
    each micro-batch's share comes normalised by the global batch's counts, so the normaliser
    is 1, and the shares of every micro-batch and data-parallel rank add up to the loss.

    `rollout_metrics()` gives the metrics of the answers being trained on (rewards, lengths,
    the rollout's time), already reduced over the data-parallel ranks. Tensor-parallel ranks
    hold the same rows and values: nothing is reduced over them. Under pipeline parallelism only
    the last stage calls micro_batch, and finish reduces over the stages (`pp_group`) too."""

    def __init__(self, posttrain, *, dp_group=None, pp_group=None, device: torch.device | str | None = None,
                 rollout_metrics=dict):
        self.loss_type, self.clip_eps = posttrain.grpo_loss_type, posttrain.grpo_clip_eps
        self.kl_coeff, self.max_new_tokens = posttrain.grpo_kl_coeff, posttrain.grpo_max_new_tokens
        self.dp_group, self.pp_group, self.rollout_metrics = dp_group, pp_group, rollout_metrics
        # This rank's [loss (its shares), KL sum, clipped tokens, answer tokens, engine-measured tokens].
        self.sums = torch.zeros(5, device=device)
        self.gap = torch.zeros((), device=device)   # max |engine log-prob - trainer log-prob|
        self.answers = self.tokens = None
        self._train_start = time.perf_counter()

    def begin(self) -> None:
        self.sums.zero_()
        self.gap.zero_()

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        """The global batch's answers and answer tokens, for the shares; returns 1."""
        counts = torch.stack([torch.tensor(float(sum(b["loss_mask"].shape[0] for b in micro_batches)),
                                           device=self.sums.device),
                              sum(b["loss_mask"].sum() for b in micro_batches).float()])
        self.answers, self.tokens = _sum(counts, self.dp_group).clamp(min=1).unbind()
        self._train_start = time.perf_counter()
        return torch.ones((), device=self.sums.device)

    def micro_batch(self, losses: torch.Tensor, batch: dict) -> torch.Tensor:
        """The share of one micro-batch from the policy's per-token losses [rows, seq] (-log pi)."""
        mask = batch["loss_mask"].to(losses.dtype)
        log_probs = -losses
        old = batch.get(OLD_LOG_PROBS)
        token_losses, kl, region = grpo_token_losses(
            log_probs, log_probs.detach() if old is None else old, batch[ADVANTAGES], self.clip_eps,
            batch.get(REFERENCE_LOG_PROBS), self.kl_coeff)
        share = aggregate(token_losses, mask, self.loss_type, answers=self.answers, tokens=self.tokens,
                          max_new_tokens=self.max_new_tokens)
        engine = batch.get(ENGINE_LOG_PROBS)
        measured = torch.zeros((), device=mask.device)
        if engine is not None:
            measured = mask.sum()
            self.gap = torch.maximum(self.gap, ((log_probs.detach() - engine).abs() * mask).max())
        self.sums += torch.stack([share.detach(), (kl * mask).sum(), (region * mask).sum(), mask.sum(),
                                  measured]).float()
        return share

    def finish(self, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of the micro-batches since `begin` and the metrics by name (TRL's where it has them)."""
        sums = _sum(_sum(self.sums.clone(), self.pp_group), self.dp_group)
        gap = _sum(_sum(self.gap.clone(), self.pp_group, dist.ReduceOp.MAX), self.dp_group, dist.ReduceOp.MAX)
        tokens = sums[3].clamp(min=1)
        if self.sums.device.type == "cuda":
            torch.cuda.synchronize(self.sums.device)
        metrics = {"kl": sums[1] / tokens, "clip_ratio": sums[2] / tokens,
                   "logprob_gap": torch.where(sums[4] > 0, gap, torch.zeros_like(gap)),
                   **self.rollout_metrics(),
                   "train_seconds": torch.tensor(time.perf_counter() - self._train_start, device=sums.device)}
        return sums[0], metrics


def _sum(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor

"""Direct preference optimisation: the loss, its metrics and the reference log-probs.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model", https://arxiv.org/abs/2305.18290) trains the policy on pairs of answers to one
prompt, chosen (c) and rejected (r), against a frozen reference, the initial policy:

    logp(y)   = sum over the answer's tokens of log pi(token)     (summed, not averaged)
    reward(y) = beta (logp_policy(y) - logp_reference(y))
    L_pref    = -mean over pairs of logsigmoid(beta ((logp(c) - logp_ref(c)) - (logp(r) - logp_ref(r))))
    L         = L_pref + w_sft x (the chosen answers' token losses, summed / their number of tokens)

This is TRL's DPOTrainer with loss_type ["sigmoid", "sft"] and loss_weights [1, w_sft]
(trl/trainer/dpo_trainer.py, `_compute_loss`) and NeMo RL's `DPOLossFn`
(nemo_rl/algorithms/loss/loss_functions.py) with preference_average_log_probs=False. The
metrics carry TRL's names: rewards/chosen, rewards/rejected, rewards/margins (chosen minus
rejected reward), rewards/accuracies (the fraction of pairs whose chosen reward is strictly
the higher), logps/chosen, logps/rejected; with NeMo RL's preference_loss and sft_loss (the
chosen answers' per-token loss, logged whatever its weight). All are means over the global batch.

Layout: a pair is two consecutive rows of a micro-batch, chosen then rejected, as in NeMo RL's
preference batches (tessera.posttrain.dpo_data). --micro-batch-size and --global-batch-size
count rows, so both are even, and a pair never straddles two micro-batches or two ranks.

Normalisation: the trainer adds up its micro-batches' objectives over micro-batches and
data-parallel ranks, so `DPOObjective.micro_batch` returns each micro-batch's share divided by
the global batch's counts: its pairs' loss sum / the global batch's pairs, plus w_sft x its
chosen tokens' loss sum / the global batch's chosen tokens. The shares add up to the loss of
the whole global batch, and so do their gradients, however the batch is split.

Context parallelism: a rank holds chunks of every row, so a row's log-probability is its
chunks' sums added over the context-parallel ranks (`answer_log_probs`). The sum goes forward
only (Megatron's g, tessera.parallel.tensor.reduce_from_tp_region): every rank then computes the
same loss, each backpropagates it into its own tokens, and the gradients' sum over the data x
context ranks counts each token once.

The reference log-probs come from one of three mechanisms, each `log_probs(batch) -> [rows]`:
a frozen copy of the initial model run on every micro-batch (`frozen_reference`: one more model
in memory, one more forward per micro-batch); with LoRA, the policy itself with its adapters
switched off (`adapters_off_reference`: one more forward, nothing more in memory); or one pass
over the dataset's rows before training (`PrecomputedReference`: nothing more in memory or per
step, one pass over the data up front), as TRL's precompute_ref_log_probs. Under pipeline
parallelism a forward pass is a schedule over all of a step's micro-batches, so the reference
runs that way, before the step (`PipelinedReference`), and the precomputed pass takes the
dataset's rows a step's worth at a time.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, ContextManager, Iterable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import default_collate

from tessera.parallel.tensor import reduce_from_tp_region
from tessera.posttrain.lora import adapters_off

Batch = dict[str, torch.Tensor]
# What the trainer supplies to run a model on a micro-batch already on the device (its autocast,
# position ids, packed documents): the per-token losses [rows, seq], -log p(label).
RunModel = Callable[[nn.Module, Batch], torch.Tensor]

# The metrics of the pairs, by TRL's names, in the order DPOObjective sums them.
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected")
REFERENCE_KEY = "reference_log_probs"   # a precomputed reference's value in each sample


def sequence_log_probs(losses: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its answer [rows]: minus its per-token losses summed where the mask is 1."""
    return -(losses * loss_mask).sum(dim=-1)


def answer_log_probs(losses: torch.Tensor, loss_mask: torch.Tensor, cp_group=None) -> torch.Tensor:
    """`sequence_log_probs` of whole rows when this rank holds chunks of them (context
    parallelism): summed over `cp_group` going forward, the gradient left with each rank's tokens."""
    return reduce_from_tp_region(sequence_log_probs(losses, loss_mask), cp_group)


def chosen_and_rejected(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The even rows (chosen answers) and the odd rows (rejected ones) of a micro-batch."""
    if rows.shape[0] % 2:
        raise ValueError(f"a DPO micro-batch holds (chosen, rejected) pairs of rows, got {rows.shape[0]} rows")
    return rows[0::2], rows[1::2]


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the sigmoid loss, the chosen answer's reward and the rejected one's (detached)."""
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_metric_sums(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, policy_chosen: torch.Tensor,
                     policy_rejected: torch.Tensor) -> torch.Tensor:
    """PAIR_METRICS summed over the pairs: divided by the number of pairs, TRL's logged values."""
    return torch.stack([chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards - rejected_rewards).sum(),
                        (chosen_rewards > rejected_rewards).sum(), policy_chosen.detach().sum(),
                        policy_rejected.detach().sum()]).float()


class DPOObjective:
    """DPO's part of a step (or evaluation): each micro-batch's share of the objective, and the
    sums behind the logged loss and metrics.

        objective.begin()
        objective.set_global_batch(loss_masks)     # this rank's micro-batches of the step
        for each micro-batch:
            share = objective.micro_batch(losses, loss_mask, reference.log_probs(batch))
            (share x loss scale).backward()
        loss, metrics = objective.finish()         # the same on every rank

    Under pipeline parallelism only the last stage calls micro_batch; finish sums over the
    stages (`pp_group`) and the data-parallel ranks (`dp_group`), never over tensor-parallel
    ranks, which hold the same values. Under context parallelism (`cp_group`) the rows' sums
    and token counts are added over the ranks holding their chunks as they are made.
    """

    def __init__(self, beta: float, sft_loss_weight: float, *, dp_group=None, pp_group=None, cp_group=None,
                 device: torch.device | str | None = None):
        self.beta, self.sft_loss_weight = beta, sft_loss_weight
        self.dp_group, self.pp_group, self.cp_group = dp_group, pp_group, cp_group
        # This rank's [preference loss sum, chosen tokens' loss sum, PAIR_METRICS sums, chosen tokens];
        # its pairs on the host (a count from shapes needs no copy to the device).
        self.sums = torch.zeros(3 + len(PAIR_METRICS), device=device)
        self.pairs = 0
        self.global_pairs = self.global_chosen_tokens = None

    def begin(self) -> None:
        self.sums.zero_()
        self.pairs = 0

    def set_global_batch(self, loss_masks: Iterable[torch.Tensor]) -> None:
        """The global batch's pairs and chosen tokens (summed over data-parallel ranks): what each
        micro-batch's share is divided by."""
        chosen = [chosen_and_rejected(mask)[0] for mask in loss_masks]
        counts = torch.stack([torch.full((), float(sum(mask.shape[0] for mask in chosen)), device=self.sums.device),
                              _sum(sum(mask.sum() for mask in chosen).float(), self.cp_group)])
        self.global_pairs, self.global_chosen_tokens = _sum(counts, self.dp_group).clamp(min=1).unbind()

    def micro_batch(self, losses: torch.Tensor, loss_mask: torch.Tensor, reference_log_probs: torch.Tensor
                    ) -> torch.Tensor:
        """This micro-batch's share of the global batch's objective, from the policy's per-token
        losses [rows, seq] and the reference's per-sequence log-probs [rows]."""
        policy_chosen, policy_rejected = chosen_and_rejected(answer_log_probs(losses, loss_mask, self.cp_group))
        reference_chosen, reference_rejected = chosen_and_rejected(reference_log_probs.to(policy_chosen.dtype))
        pair_losses, chosen_rewards, rejected_rewards = dpo_loss(
            policy_chosen, policy_rejected, reference_chosen, reference_rejected, self.beta)
        preference, chosen_nll = pair_losses.sum(), -policy_chosen.sum()   # the chosen tokens' losses, summed
        self.pairs += pair_losses.shape[0]
        self.sums += torch.cat([
            torch.stack([preference.detach(), chosen_nll.detach()]),
            pair_metric_sums(chosen_rewards, rejected_rewards, policy_chosen, policy_rejected),
            _sum(chosen_and_rejected(loss_mask)[0].sum().float().reshape(1), self.cp_group)])
        share = preference / self.global_pairs
        if self.sft_loss_weight:
            share = share + self.sft_loss_weight * chosen_nll / self.global_chosen_tokens
        return share

    def finish(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective over every micro-batch since `begin` (L_pref + w_sft x SFT loss) and the
        metrics by name, means over those micro-batches' pairs (the SFT loss over their chosen tokens)."""
        sums = torch.cat([self.sums, torch.full((1,), float(self.pairs), device=self.sums.device)])
        sums = _sum(_sum(sums, self.pp_group), self.dp_group)
        chosen_tokens, pairs = sums[-2].clamp(min=1), sums[-1].clamp(min=1)
        preference, sft = sums[0] / pairs, sums[1] / chosen_tokens
        metrics = {"preference_loss": preference, "sft_loss": sft,
                   **dict(zip(PAIR_METRICS, (sums[2:-2] / pairs).unbind()))}
        return preference + self.sft_loss_weight * sft, metrics


def _sum(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor


# -- the reference ----------------------------------------------------------------------


class Reference(Protocol):
    def prepare(self, micro_batches: list[Batch]) -> None:
        """Called with a step's (or an evaluation batch's) micro-batches before any of them runs."""

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """The reference's log-probability of each row's answer [rows], without gradient."""


class ModelReference:
    """The reference computed by running a model on each micro-batch, in evaluation mode (no
    dropout, and MoE routers do not count its tokens), inside `context(model)`."""

    def __init__(self, model: nn.Module, run_model: RunModel,
                 context: Callable[[nn.Module], ContextManager] = contextlib.nullcontext, cp_group=None):
        self.model, self.run_model, self.context, self.cp_group = model, run_model, context, cp_group

    def prepare(self, micro_batches: list[Batch]) -> None:
        pass   # each micro-batch runs when the objective asks for it

    @torch.no_grad()
    def log_probs(self, batch: Batch) -> torch.Tensor:
        with self.context(self.model), eval_mode(self.model):
            return answer_log_probs(self.run_model(self.model, batch), batch["loss_mask"], self.cp_group)


def frozen_reference(model: nn.Module, run_model: RunModel) -> ModelReference:
    """A frozen copy of the initial model: made before the policy trains (and before it is
    compiled, sharded or cast to FP8), run on every micro-batch. The copy shares the model's
    process groups (a MoE router's), which cannot be copied."""
    groups = {id(value): value for module in model.modules() for value in vars(module).values()
              if isinstance(value, dist.ProcessGroup)}
    return ModelReference(copy.deepcopy(model, memo=groups).requires_grad_(False), run_model)


def adapters_off_reference(model: nn.Module, run_model: RunModel, cp_group=None) -> ModelReference:
    """With LoRA the initial model is the policy with its adapters switched off
    (tessera.posttrain.lora.adapters_off): no copy."""
    return ModelReference(model, run_model, adapters_off, cp_group)


class PrecomputedReference:
    """Reference log-probs computed once, before training (`precompute_reference_log_probs`), and
    attached to the datasets: each sample carries its row's value under REFERENCE_KEY."""

    def prepare(self, micro_batches: list[Batch]) -> None:
        pass   # the loader brought the values

    @staticmethod
    def log_probs(batch: Batch) -> torch.Tensor:
        return batch[REFERENCE_KEY]


class PipelinedReference(PrecomputedReference):
    """The reference of a pipelined model: `fill(micro_batches)` runs the step's micro-batches
    through the pipeline's forward-only schedule before the step and stores each one's
    log-probs under REFERENCE_KEY on every stage (the trainer's `_pipeline_reference`)."""

    def __init__(self, fill: Callable[[list[Batch]], None]):
        self.fill = fill

    def prepare(self, micro_batches: list[Batch]) -> None:
        self.fill(micro_batches)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def precompute_reference_log_probs(dataset, reference: Reference, *, micro_batch_size: int, device: torch.device | str,
                                   place: Callable[[Batch], Batch] | None = None, micro_batches: int = 1,
                                   dp_rank: int = 0, dp_size: int = 1, dp_group=None) -> torch.Tensor:
    """The reference's log-probs of every row of a preference dataset (`dataset.num_rows`,
    `dataset.row(i)`), computed by `reference` (of the initial model: the model itself before it
    trains, or with LoRA its adapters off) and shared by the data-parallel ranks: each computes a
    contiguous block of rows, `micro_batches` micro-batches at a time (a step's worth under
    pipeline parallelism), the same number of the same size on every rank (the last padded with
    repeats, their values dropped), so that collectives inside the model (FSDP, pipeline) line up.
    `place` puts a collated micro-batch where the model reads it (the trainer's: on its device,
    cut into this rank's context-parallel chunks); by default on `device`.
    Attach the result with `dataset.attach_reference_log_probs`."""
    num_rows, per_call = dataset.num_rows, micro_batch_size * micro_batches
    per_rank = math.ceil(num_rows / dp_size)
    per_rank += -per_rank % per_call
    first = dp_rank * per_rank
    place = place or (lambda batch: {k: v.to(device) for k, v in batch.items()})
    values = torch.zeros(num_rows, dtype=torch.float32, device=device)
    for start in range(first, first + per_rank, per_call):
        batches = [place(_rows(dataset, range(begin, begin + micro_batch_size)))
                   for begin in range(start, start + per_call, micro_batch_size)]
        reference.prepare(batches)
        rows = range(start, min(start + per_call, num_rows))
        values[rows.start:rows.stop] = torch.cat([reference.log_probs(batch) for batch in batches])[:len(rows)].float()
    return _sum(values, dp_group).cpu()


def _rows(dataset, rows: range) -> Batch:
    """A micro-batch of the dataset's rows, a row past the last one repeating the last."""
    return default_collate([dataset.row(min(row, dataset.num_rows - 1)) for row in rows])


class PreferenceTerms:
    """DPO as the trainer's objective, with the interface of tessera.training.losses.LossTerms:
    the shares come normalised (by the global batch's pairs), so the normaliser is 1."""

    def __init__(self, objective: DPOObjective, reference: Reference):
        self.objective, self.reference = objective, reference

    def begin(self) -> None:
        self.objective.begin()

    def normaliser(self, micro_batches: list[Batch]) -> torch.Tensor:
        self.reference.prepare(micro_batches)
        self.objective.set_global_batch([batch["loss_mask"] for batch in micro_batches])
        return torch.ones((), device=self.objective.sums.device)

    def micro_batch(self, losses: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.objective.micro_batch(losses, batch["loss_mask"], self.reference.log_probs(batch))

    def finish(self, normaliser: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.objective.finish()

"""GRPO's rollouts: answers sampled by the inference engine from the model being trained, rewarded,
and cut into the trainer's micro-batches.

    rollouts = Rollouts(model, prompts, tokenizer, config, mesh, device=..., log_probs=...)
    batch = next(rollouts)     # what the trainer asks for, --global-batch-size rows a step

Every --grpo-iterations steps, each data-parallel rank takes its share of the next
--global-batch-size / --grpo-group-size prompts, and the engine (tessera.inference.engine:
continuous batching over a paged KV cache) samples --grpo-group-size answers to each, reading
the trainer's own parameters: nothing is copied, and an optimizer step is seen by the next
rollout as it is. The engine is built at the first rollout and kept; its KV cache holds
exactly one rollout (its rows, of at most --seq-length tokens) and stays allocated while the
model trains, or with --rl-kv-cache-management-mode recompute is freed after each rollout (and
made again, its CUDA graphs captured again, for the next). The rows a rank trains are the rows it sampled, so a group's rewards and
advantages (tessera.posttrain.grpo) never leave the rank.

Each answer becomes a row as a pretraining sample is one (--seq-length + 1 token slots:
inputs the first s, labels the last s), the prompt then the answer then padding; the loss
mask is 1 on the answer's tokens, its end-of-sequence token included when it has one.
Truncation: an answer stops at --grpo-max-new-tokens, or where the prompt + answer fill
--seq-length; it is rewarded and trained as it stands (TRL's default,
mask_truncated_completions=False) and counted in `completions/clipped_ratio`.

Determinism: answer j to the run's k-th prompt is sampled with a seed drawn from (--seed, k, j),
and the engine's draws depend on that seed and the logits alone (tessera.inference.sampling).
So the rows do not depend on the data-parallel layout, and tensor-parallel ranks, which see
the same logits, sample the same tokens; the rewards are computed on each tensor-parallel
group's first rank and shared, so that a reward that is not deterministic cannot split them.

Log-probs: the engine reports each sampled token's log-prob, and the first step on a batch
measures how far the trainer's forward pass is from it (`logprob_gap`). pi_old and the
reference are the trainer's own forward pass (`log_probs`: on each micro-batch, or under
pipeline parallelism the forward-only schedule over them all): with --grpo-iterations > 1 the
model's log-probs before the first step, with --grpo-kl-coeff > 0 the reference's (the
model with its LoRA adapters off, or a frozen copy of the initial model), both in evaluation
mode and on the step's own micro-batches, so that the first step's ratio is exactly 1.
A resume starts a new batch of answers (with the same prompts and seeds) at the step it
stopped at, from the weights it saved.

Pipeline parallelism: the engine runs the whole model, which every rank of a pipeline group
gathers from the stages before each rollout (tessera.posttrain.grpo_gather); all of them sample
the same answers, so every stage builds the same micro-batches. The rewards are computed on the
first rank of each tensor-parallel group of the first stage and shared.

MoE: with --moe-enable-routing-replay the engine records each token's experts and every
training forward on the rows routes them there (tessera.posttrain.grpo_replay); without it
the trainer's routers choose for themselves.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Callable, ContextManager

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tessera.config import RunConfig
from tessera.inference.engine import Completion, Engine
from tessera.inference.sampling import SamplingParams
from tessera.parallel.mesh import Mesh
from tessera.posttrain.dpo import eval_mode
from tessera.posttrain.grpo import (
    ADVANTAGES, ENGINE_LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS, group_advantages,
)
from tessera.posttrain.grpo_data import Prompt, PromptSet
from tessera.posttrain.grpo_gather import WholeModel
from tessera.posttrain.grpo_replay import ROUTED_EXPERTS, RouterReplay, routed_experts_row
from tessera.posttrain.rewards import Rewards
from tessera.posttrain.sft_data import ChatTokenizer

Batch = dict[str, torch.Tensor]
# The trainer's forward pass of a model on a micro-batch: per-token losses [rows, seq], -log p(label).
RunModel = Callable[[nn.Module, Batch], torch.Tensor]
# log_probs(model, context, micro_batches, key) stores under `key` each micro-batch's per-token
# log-probs [rows, seq] of `model`, run in evaluation mode inside `context(model)`, without gradient.
LogProbs = Callable[[nn.Module, Callable[[nn.Module], ContextManager], list[Batch], str], None]


def sample_seed(seed: int, prompt_index: int, sample: int) -> int:
    return int(np.random.SeedSequence([seed, prompt_index, sample]).generate_state(1, np.uint64)[0] >> 1)


def log_probs_by_micro_batch(run_model: RunModel) -> LogProbs:
    """LogProbs by the trainer's forward pass on each micro-batch in turn."""
    @torch.no_grad()
    def log_probs(model: nn.Module, context, micro_batches: list[Batch], key: str) -> None:
        with context(model), eval_mode(model):
            for batch in micro_batches:
                batch[key] = -run_model(model, batch).float()

    return log_probs


def answer_row(prompt_ids: list[int], completion: Completion, seq_length: int, pad: int
               ) -> tuple[list[int], list[int], list[float], list[float]]:
    """(tokens, labels, loss mask, engine log-probs) of one answer, each of --seq-length."""
    sequence = prompt_ids + completion.token_ids
    slots = sequence + [pad] * (seq_length + 1 - len(sequence))
    first, last = len(prompt_ids) - 1, len(sequence) - 1   # the label positions of the answer's tokens
    mask = [0.0] * first + [1.0] * (last - first) + [0.0] * (seq_length - last)
    logprobs = [0.0] * first + list(completion.logprobs) + [0.0] * (seq_length - last)
    return slots[:-1], slots[1:], mask, logprobs


class Rollouts:
    """This rank's micro-batches of GRPO's steps, sampled every --grpo-iterations steps."""

    def __init__(self, model: nn.Module, prompts: PromptSet, tokenizer: ChatTokenizer, config: RunConfig,
                 mesh: Mesh, *, device: torch.device, log_probs: LogProbs, reference: nn.Module | None = None,
                 before_rollout: Callable[[], None] = lambda: None, start_iteration: int = 0):
        post, train = config.posttrain, config.train
        self.model, self.prompts, self.tokenizer, self.mesh = model, prompts, tokenizer, mesh
        self.device, self.log_probs, self.before_rollout = device, log_probs, before_rollout
        self.group_size, self.iterations, self.seed = post.grpo_group_size, post.grpo_iterations, train.seed
        self.seq_length, self.micro_batch_size = config.model.seq_length, train.micro_batch_size
        self.rows = train.global_batch_size // mesh.dp_size            # this rank's, each step
        self.prompts_per_step = train.global_batch_size // self.group_size
        self.rewards = Rewards.from_flags(post.grpo_reward, post.grpo_format_regex)
        self.sampling = dict(temperature=post.grpo_temperature, top_p=post.grpo_top_p, logprobs=0)
        self.max_new_tokens = post.grpo_max_new_tokens
        # The reference's forward pass: the model with its adapters off (LoRA), or a frozen copy.
        self.reference = None
        if post.grpo_kl_coeff > 0:
            from tessera.posttrain.lora import adapters_off

            self.reference = (model, adapters_off) if post.lora else (reference, contextlib.nullcontext)
        self.replay = None
        if post.moe_enable_routing_replay:
            self.replay = RouterReplay([model] + ([reference] if reference is not None else []))
        self.engine: Engine | None = None
        self.release_engine = post.rl_kv_cache_management_mode == "recompute"
        # What the engine reads: the model, or under pipeline parallelism the stages gathered.
        self.engine_model = WholeModel(model, config, mesh, device, keep=not self.release_engine) \
            if mesh.pp_size > 1 else lambda: model
        self.rollout = start_iteration // self.iterations
        self._queue: deque[Batch] = deque()
        self._skip = start_iteration % self.iterations   # a resume inside a batch's iterations: the rest of them
        self._metrics: dict[str, torch.Tensor] = {}
        self._rollout_seconds = 0.0

    def __iter__(self) -> "Rollouts":
        return self

    def __next__(self) -> Batch:
        if not self._queue:
            self._queue.extend(self._next_rollout())
        return self._queue.popleft()

    def metrics(self) -> dict[str, torch.Tensor]:
        """The metrics of the answers of the current step (TRL's names) and the seconds this step sampled for."""
        seconds, self._rollout_seconds = self._rollout_seconds, 0.0
        return {**self._metrics, "rollout_seconds": torch.tensor(seconds, device=self.device)}

    # -- one rollout ----------------------------------------------------------------

    def _next_rollout(self) -> list[Batch]:
        """The micro-batches of the next --grpo-iterations steps (fewer after a resume inside them)."""
        start = time.perf_counter()
        first = self.rollout * self.prompts_per_step + self.mesh.dp_rank * (self.rows // self.group_size)
        prompts = [(first + i, self.prompts[first + i]) for i in range(self.rows // self.group_size)]
        completions = self._sample(prompts)
        rewards = self._rewards(prompts, completions)
        advantages = group_advantages(rewards.sum(dim=1), self.group_size)
        answers = [completion for group in completions for completion in group]
        rows = [answer_row(prompt.token_ids, completion, self.seq_length, self.tokenizer.pad)
                for (_, prompt), group in zip(prompts, completions) for completion in group]
        micro_batches = [self._micro_batch(rows[i:i + self.micro_batch_size],
                                           advantages[i:i + self.micro_batch_size],
                                           answers[i:i + self.micro_batch_size])
                         for i in range(0, len(rows), self.micro_batch_size)]
        self._log_probs(micro_batches)
        self._metrics = self._rollout_metrics(rewards, completions)
        self._rollout_seconds = time.perf_counter() - start
        self.rollout += 1
        later = [{k: v for k, v in batch.items() if k != ENGINE_LOG_PROBS} for batch in micro_batches]
        steps = [micro_batches] + [later] * (self.iterations - 1)
        steps, self._skip = steps[self._skip:], 0
        return [batch for step in steps for batch in step]

    def _sample(self, prompts: list[tuple[int, Prompt]]) -> list[list[Completion]]:
        """--grpo-group-size answers to each prompt, from the engine, in evaluation mode."""
        self.before_rollout()
        if self.replay is not None:
            self.replay.clear()
        ids, params = [], []
        for index, prompt in prompts:
            room = min(self.max_new_tokens, self.seq_length - len(prompt.token_ids))
            for sample in range(self.group_size):
                ids.append(prompt.token_ids)
                params.append(SamplingParams(max_tokens=room, seed=sample_seed(self.seed, index, sample),
                                             **self.sampling))
        model = self.engine_model()
        with eval_mode(model):   # the engine puts its model in evaluation mode: the step trains in training mode
            if self.engine is None:
                self.engine = Engine(model, max_requests=self.rows, max_seq_length=self.seq_length,
                                     eos_token_ids=self._stop_ids(), seed=self.seed, vocab_size=model.vocab_size,
                                     record_routing=self.replay is not None)
            completions = self.engine.generate(ids, params)
        if self.release_engine:   # its KV blocks, states and graphs' memory go to training
            self.engine = None
        return [completions[i:i + self.group_size] for i in range(0, len(completions), self.group_size)]

    def _stop_ids(self) -> tuple[int, ...]:
        """Where an answer ends: the tokenizer's end of document, and its chat template's end of turn."""
        template_eos = getattr(self.tokenizer.template, "eos_token_id", None)
        return tuple(dict.fromkeys([self.tokenizer.eod] + ([int(template_eos)] if template_eos is not None else [])))

    def _rewards(self, prompts: list[tuple[int, Prompt]], completions: list[list[Completion]]) -> torch.Tensor:
        """[answers, rewards] on this rank's device, the same on every tensor-parallel and pipeline rank."""
        values = torch.zeros(self.rows, len(self.rewards.functions))
        if self.mesh.tp_rank == 0 and self.mesh.pp_rank == 0:
            for g, ((_, prompt), group) in enumerate(zip(prompts, completions)):
                for j, completion in enumerate(group):
                    values[g * self.group_size + j] = torch.tensor(self.rewards.score(
                        prompt.prompt, self._text(completion), prompt.answer, prompt.where))
        values = values.to(self.device)
        for group in (self.mesh.group("pp"), self.mesh.tp_group):   # the first stage's, then tp rank 0's
            if group is not None:
                dist.broadcast(values, src=dist.get_global_rank(group, 0), group=group)
        return values

    def _text(self, completion: Completion) -> str:
        """The answer's text for the rewards: without its end-of-sequence token, nor the ids of the
        model's padding rows (the engine samples the vocabulary the trainer scores, padding included)."""
        ids = completion.token_ids[:-1] if completion.finish_reason == "stop" else completion.token_ids
        return self.tokenizer.text.detokenize([i for i in ids if i < self.tokenizer.vocab_size])

    def _micro_batch(self, rows: list[tuple], advantages: torch.Tensor, answers: list[Completion]) -> Batch:
        tokens, labels, mask, logprobs = zip(*rows)
        batch = {"tokens": torch.tensor(tokens, device=self.device), "labels": torch.tensor(labels, device=self.device),
                 "loss_mask": torch.tensor(mask, device=self.device), ADVANTAGES: advantages,
                 ENGINE_LOG_PROBS: torch.tensor(logprobs, device=self.device)}
        if self.replay is not None:
            experts = [routed_experts_row(answer, self.seq_length) for answer in answers]
            batch[ROUTED_EXPERTS] = torch.stack(experts).to(self.device)
            self.replay.add(batch)
        return batch

    def _log_probs(self, micro_batches: list[Batch]) -> None:
        """pi_old's (--grpo-iterations > 1) and the reference's (--grpo-kl-coeff > 0) per-token
        log-probs, by the trainer's forward pass."""
        if self.iterations > 1:
            self.log_probs(self.model, contextlib.nullcontext, micro_batches, OLD_LOG_PROBS)
        if self.reference is not None:
            model, context = self.reference
            self.log_probs(model, context, micro_batches, REFERENCE_LOG_PROBS)

    def _rollout_metrics(self, rewards: torch.Tensor, completions: list[list[Completion]]) -> dict[str, torch.Tensor]:
        """Means over the global batch's answers (groups for the std), by TRL's names."""
        answers = [c for group in completions for c in group]
        total = rewards.sum(dim=1)
        group_std = total.view(-1, self.group_size).std(dim=1) if self.group_size > 1 else torch.zeros_like(total)
        sums = torch.cat([total.sum()[None], group_std.sum()[None], (group_std == 0).float().sum()[None],
                          rewards.sum(dim=0),
                          torch.tensor([sum(len(c.token_ids) for c in answers),
                                        sum(c.finish_reason == "length" for c in answers)],
                                       dtype=torch.float32, device=self.device)]).float()
        dp_group = self.mesh.dp_group
        if dp_group is not None:
            dist.all_reduce(sums, group=dp_group)
        answers_count, groups = float(self.rows * self.mesh.dp_size), float(self.prompts_per_step)
        names = [f"rewards/{name}/mean" for name in self.rewards.functions]
        return {"reward": sums[0] / answers_count, "reward_std": sums[1] / groups,
                "frac_reward_zero_std": sums[2] / groups,
                **dict(zip(names, sums[3:3 + len(names)] / answers_count)),
                "completions/mean_length": sums[-2] / answers_count,
                "completions/clipped_ratio": sums[-1] / answers_count}

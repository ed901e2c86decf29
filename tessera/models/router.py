"""The router of a MoE layer: which experts each token goes to and with what weight, and
the load-balancing losses that keep the experts evenly used.

Semantics and flags are Megatron-Core's (TopKRouter in megatron/core/transformer/moe/router.py):

    softmax          top-k of the logits, then softmax over the k chosen (= Mixtral's softmax,
                     top-k, renormalise); --moe-router-pre-softmax: softmax over all experts,
                     then top-k, not renormalised (Qwen2-MoE)
    sigmoid          sigmoid scores; the top-k is chosen on scores + expert bias (aux-loss-free
                     balancing) but weighted by the unbiased scores, renormalised over the k
    groups           --moe-router-num-groups G / --moe-router-group-topk g: a group's score is the
                     sum of its best k/g scores; only the best g groups may be chosen (DeepSeek)
    capacity         --moe-expert-capacity-factor: an expert keeps at most ceil(T k / E x factor)
                     of this rank's tokens, the most probable or the first; the others lose it

Load-balancing losses are computed on their own scores (softmax over all experts, or the
sigmoid scores normalised over all experts) and a plain top-k, as Megatron does. Token
counts are summed over the ranks that hold one micro-batch (`loss_group`: TP x CP under
sequence parallelism), so each rank's loss is its part of the micro-batch's loss and the
parts add up; `global_aux_loss` counts over the whole stage (`global_group`) and over the
step's micro-batches so far.

The router also records, while training, the tokens each expert received and each loss's
unweighted value, summed over the step's micro-batches (`tokens_per_expert`,
`loss_totals`): the trainer logs them and updates the expert bias from them once per step.

Router replay (Megatron-Core's RouterReplay, megatron/core/transformer/moe/router_replay.py):
while `recorded` is a list, each forward appends the experts it chose [T, k]; while `replay`
is set ([T, k], -1 for a token left to the router), those experts are used instead of the
router's own top-k, weighted by the current scores at them, so the router still learns.
GRPO records its rollouts' routing and replays it in training (tessera.posttrain.grpo_replay).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig
from tessera.config.moe import aux_loss_coefficients
from tessera.parallel.experts import Routing
from tessera.parallel.sharding import ShardSpec, annotate, rank_and_size

_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss", "z_loss": "z_loss"}   # Megatron's log names


def loss_coefficients(config: ModelConfig) -> dict[str, float]:
    """{loss: coefficient} of the router's losses that are on: load balancing, z-loss."""
    coefficients = aux_loss_coefficients(config)
    if config.moe_z_loss_coeff:
        coefficients["z_loss"] = config.moe_z_loss_coeff
    return coefficients


class Router(nn.Module):
    def __init__(self, config: ModelConfig, *, tp_group=None, sequence_parallel: bool = False,
                 loss_group=None, global_group=None):
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.score_function, self.pre_softmax = config.moe_router_score_function, config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.num_groups, self.group_topk = config.moe_router_num_groups, config.moe_router_group_topk
        self.dtype = _DTYPES.get(config.moe_router_dtype)
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_policy, self.pad_to_capacity = config.moe_token_drop_policy, config.moe_pad_expert_input_to_capacity
        self.loss_group, self.global_group = loss_group, global_group
        self.coefficients = loss_coefficients(config)
        self.loss_names = list(self.coefficients)
        tp_rank, tp_size = rank_and_size(tp_group)
        shape = (self.num_experts, config.hidden_size)
        # Replicated over TP; under SP each rank routes its own tokens (a partial gradient).
        self.weight = annotate(nn.Parameter(torch.empty(shape)), ShardSpec(shape, None, None, tp_rank, tp_size),
                               init_std=config.init_method_std, sequence_parallel=sequence_parallel)
        # Megatron's router has a bias when the linear layers do (GPT-OSS's router bias).
        self.bias = annotate(nn.Parameter(torch.empty(self.num_experts)), ShardSpec((self.num_experts,), None, None,
                                                                                    tp_rank, tp_size),
                             init_std=config.init_method_std, sequence_parallel=sequence_parallel) \
            if config.add_bias_linear else None
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts))   # saved: part of the model
        else:
            self.expert_bias = None
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts), persistent=False)
        self.register_buffer("loss_totals", torch.zeros(len(self.loss_names)), persistent=False)
        self.register_buffer("global_tokens_per_expert", torch.zeros(self.num_experts), persistent=False)
        self.register_buffer("global_micro_batches", torch.zeros(()), persistent=False)
        self.recording = True   # off while full recomputation replays a forward
        self.recorded: list[torch.Tensor] | None = None   # router replay: each forward's experts [T, k]
        self.replay: torch.Tensor | None = None           # router replay: the experts to use [T, k]

    def forward(self, x: torch.Tensor, batch_size: int) -> tuple[Routing, torch.Tensor | None]:
        """Routing of x [tokens, hidden] (`batch_size` sequences, token-major), and the weighted sum of
        the load-balancing losses for the gradient (None when none is on)."""
        logits = self.logits(x)
        probs, experts = self.top_k(logits)
        routing, counts = self._apply_capacity(probs, experts) if self.capacity_factor else self._dropless(probs, experts)
        losses = self.losses(logits, batch_size)
        if self.training and self.recording and torch.is_grad_enabled():
            with torch.no_grad():
                self.tokens_per_expert += counts
                if losses:
                    self.loss_totals += torch.stack(list(losses.values()))
        weighted = [self.coefficients[name] * value for name, value in losses.items()]
        return routing, (sum(weighted) if weighted else None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.dtype is None:
            return F.linear(x, self.weight, self.bias)   # in the autocast dtype, like every other GEMM
        with torch.autocast(x.device.type, enabled=False):
            bias = self.bias.to(self.dtype) if self.bias is not None else None
            return F.linear(x.to(self.dtype), self.weight.to(self.dtype), bias)

    # -- choosing experts ------------------------------------------------------------------

    def top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of every token."""
        if self.score_function == "softmax":
            if self.pre_softmax:
                probs, experts = self._select(logits.float().softmax(dim=-1))
            else:
                top, experts = self._select(logits)
                probs = top.float().softmax(dim=-1)
        else:
            scores = logits.float().sigmoid()
            if self.expert_bias is not None:
                _, experts = self._select(scores + self.expert_bias)
                probs = scores.gather(1, experts)
            else:
                probs, experts = self._select(scores)
            if self.topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if self.scaling_factor:
            probs = probs * self.scaling_factor
        return probs, experts

    def _select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of scores [T, E] (the replayed experts where `replay` gives them), and the scores there."""
        top, experts = self._own_top_k(scores)
        if self.recorded is not None:
            self.recorded.append(experts)
        if self.replay is None:
            return top, experts
        experts = torch.where(self.replay >= 0, self.replay, experts)
        return scores.gather(1, experts), experts

    def _own_top_k(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of scores [T, E], limited to the best groups with group-limited routing."""
        if self.num_groups:
            tokens = scores.shape[0]
            grouped = scores.view(tokens, self.num_groups, -1)
            group_scores = grouped.topk(self.topk // self.group_topk, dim=-1).values.sum(dim=-1)
            best_groups = group_scores.topk(self.group_topk, dim=-1).indices
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            scores = scores.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        return scores.topk(self.topk, dim=-1)

    def _dropless(self, probs: torch.Tensor, experts: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        tokens, k = experts.shape
        token_index = torch.arange(tokens, device=experts.device).repeat_interleave(k)
        routing = Routing(token_index, experts.flatten(), probs.flatten(), tokens, per_token=k)
        return routing, _count(experts.flatten(), self.num_experts)

    def capacity(self, tokens: int) -> int:
        """Rows an expert keeps of this rank's `tokens` (at most all of them)."""
        return min(math.ceil(tokens * self.topk / self.num_experts * self.capacity_factor), tokens)

    def _apply_capacity(self, probs: torch.Tensor, experts: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """Each expert keeps its `capacity` most probable (--moe-token-drop-policy probs) or
        earliest (position) tokens; with --moe-pad-expert-input-to-capacity it takes exactly
        `capacity` rows, the rest of them other tokens with weight 0."""
        tokens = experts.shape[0]
        dense = torch.zeros(tokens, self.num_experts, device=probs.device).scatter(1, experts, probs)
        routed = torch.zeros_like(dense, dtype=torch.bool).scatter_(1, experts, True)
        if self.drop_policy == "probs":
            priority = dense.detach()
        else:   # routed tokens first, each group in order of position
            position = torch.arange(tokens, 0, -1, device=probs.device, dtype=torch.float32).unsqueeze(1)
            priority = routed * float(tokens) + position
        kept = priority.topk(self.capacity(tokens), dim=0).indices   # [capacity, E] token ids
        in_capacity = torch.zeros_like(routed).scatter_(0, kept, True)
        counts = (routed & in_capacity).sum(dim=0).float()
        if self.pad_to_capacity:
            token_index = kept.t().flatten()   # expert-major, exactly `capacity` rows each
            expert_index = torch.arange(self.num_experts, device=probs.device).repeat_interleave(kept.shape[0])
            return Routing(token_index, expert_index, dense[token_index, expert_index], tokens), counts
        token_index, expert_index = (routed & in_capacity).nonzero(as_tuple=True)
        return Routing(token_index, expert_index, dense[token_index, expert_index], tokens, same_size=False), counts

    # -- load balancing ----------------------------------------------------------------------

    def losses(self, logits: torch.Tensor, batch_size: int) -> dict[str, torch.Tensor]:
        """The unweighted load-balancing losses that are on, by name (this rank's part)."""
        if not self.loss_names:
            return {}
        losses = {}
        scores = logits.float().softmax(dim=-1) if self.score_function == "softmax" else _normalized(logits.float())
        routed = torch.zeros_like(scores).scatter_(1, scores.topk(self.topk, dim=-1).indices, 1.0)
        e, k = self.num_experts, self.topk
        if "aux_loss" in self.coefficients:
            counts, tokens = _all_reduce(routed.sum(dim=0), self.loss_group), scores.shape[0] * _size(self.loss_group)
            losses["aux_loss"] = e / (k * tokens**2) * (scores.sum(dim=0) * counts).sum()
        if "seq_aux_loss" in self.coefficients:
            per_sequence = routed.view(batch_size, -1, e).sum(dim=1)
            counts, length = _all_reduce(per_sequence, self.loss_group), scores.shape[0] // batch_size * _size(self.loss_group)
            mass = scores.view(batch_size, -1, e).sum(dim=1)
            losses["seq_aux_loss"] = e / (k * length**2) * (mass * counts).sum() / batch_size
        if "global_aux_loss" in self.coefficients:
            losses["global_aux_loss"] = self._global_aux_loss(scores, routed)
        if "z_loss" in self.coefficients:
            losses["z_loss"] = torch.logsumexp(logits.float(), dim=-1).square().mean() / _size(self.loss_group)
        return losses

    def _global_aux_loss(self, scores: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """Counts over the whole stage and the step's micro-batches so far (arXiv 2501.11873). Each
        rank's value is its part of the stage's loss, so it is scaled by the data-parallel size to
        take the same gradient weight as the per-micro-batch losses (which DP ranks each hold whole)."""
        counts = _all_reduce(routed.sum(dim=0), self.global_group)
        with torch.no_grad():
            if self.training and self.recording:
                self.global_tokens_per_expert += counts
                self.global_micro_batches += 1
            running = counts if not (self.training and self.recording) else \
                self.global_tokens_per_expert / self.global_micro_batches
        tokens = scores.shape[0] * _size(self.global_group)
        data_parallel = _size(self.global_group) // _size(self.loss_group)
        return data_parallel * self.num_experts / (self.topk * tokens**2) * (scores.sum(dim=0) * running).sum()

    def reset_statistics(self) -> None:
        """Zero the per-step sums (the trainer calls it after reading them)."""
        for buffer in (self.tokens_per_expert, self.loss_totals, self.global_tokens_per_expert,
                       self.global_micro_batches):
            buffer.zero_()


def _normalized(logits: torch.Tensor) -> torch.Tensor:
    scores = logits.sigmoid()
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def _count(expert_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Pairs per expert, without a device-to-host sync (bincount would need the max on the host)."""
    counts = torch.zeros(num_experts, device=expert_index.device)
    return counts.scatter_add_(0, expert_index, torch.ones_like(expert_index, dtype=counts.dtype))


def _size(group) -> int:
    return rank_and_size(group)[1]


def _all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, group=group)
    return tensor

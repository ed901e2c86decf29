"""MoE router replay for GRPO (--moe-enable-routing-replay): the training forward of a rollout's
rows sends each token to the experts the inference engine sent it to while sampling.

An MoE policy samples its answers with one routing and would be trained with another: the
engine's steps batch the tokens differently, and a router whose scores nearly tie flips its
top-k on a rounding difference, so pi_old's and pi's experts, and the log-probs through them,
drift apart (GSPO, arXiv 2507.18071, on the instability this causes: its "Routing Replay"). Replay removes that
part of the drift: the engine records each token's top-k experts per MoE layer
(tessera.inference.routing), and every forward of the trainer on those rows (pi_old's and the
reference's log-probs, the policy step, and a full recomputation inside its backward) routes
each token there. The gate weights are still computed from the current router scores at those
experts, so the router keeps its gradient: Megatron-Core's RouterReplay
(megatron/core/transformer/moe/router_replay.py, REPLAY_FORWARD gathers the scores at the
replayed indices). The load-balancing losses keep the router's own top-k, as Megatron's do.

The record is keyed by sequence and position: row i of a micro-batch carries its answer's
experts at the positions of its input tokens, ROUTED_EXPERTS [rows, seq, MoE layers, k]
(int16), -1 where the engine ran no forward (the answer's last token, padding), and there the
router chooses for itself; those positions feed no trained log-prob.

The trainer calls the model on a micro-batch's own "tokens" tensor, so a forward pre-hook finds
the micro-batch by that tensor and sets each router's `replay` before the layers run; it stays
set until the model's next forward, so a recomputation in backward replays it too. A forward on
any other tokens routes by itself.
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.inference.engine import Completion
from tessera.inference.routing import moe_routers

ROUTED_EXPERTS = "routed_experts"   # [rows, seq, MoE layers, k]: the engine's experts, -1 where none


def routed_experts_row(completion: Completion, seq_length: int) -> torch.Tensor:
    """[seq_length, MoE layers, k] of one answer's row: the engine's experts of the prompt and answer, then -1."""
    recorded = completion.routed_experts[:seq_length]
    padding = recorded.new_full((seq_length - recorded.shape[0], *recorded.shape[1:]), -1)
    return torch.cat([recorded, padding])


class RouterReplay:
    """Replays the routing of registered micro-batches in every forward of `models` on them."""

    def __init__(self, models: list[nn.Module]):
        self.routers = {id(model): moe_routers(model) for model in models}
        self._batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(tokens): (tokens, experts)
        for model in models:
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """Replay batch[ROUTED_EXPERTS] whenever a model runs on batch["tokens"]."""
        tokens = batch["tokens"]
        self._batches[id(tokens)] = tokens, batch[ROUTED_EXPERTS]

    def clear(self) -> None:
        """Forget the micro-batches, and let the routers choose (before the engine samples)."""
        self._batches.clear()
        for routers in self.routers.values():
            for router in routers:
                router.replay = None

    def _before_forward(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("input_ids")
        tokens_and_experts = self._batches.get(id(tokens))
        experts = tokens_and_experts[1] if tokens_and_experts is not None and tokens_and_experts[0] is tokens \
            else None
        for layer, router in enumerate(self.routers[id(model)]):
            router.replay = None if experts is None else experts[:, :, layer].reshape(-1, router.topk).long()

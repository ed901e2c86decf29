"""The experts each token of a request was routed to, as the engine ran it (MoE router replay).

GRPO trains on the engine's answers; with --moe-enable-routing-replay its training forward sends
each token to the experts the engine chose for it (tessera.posttrain.grpo_replay), as Megatron-LM
records routing in its inference engine for RL (megatron/core/inference/contexts/routing_metadata.py).
A step mixes requests and cuts prompts into chunks, so each forward's experts [tokens, k] per MoE
layer are written to their request at their positions: `Request.routed_experts`
[prompt + max new tokens, MoE layers, k], int16 (int32 past 32767 experts), -1 where no forward
ran the token (the last sampled one, which no step feeds back). A preempted request's recomputed
tokens overwrite their first routing.

The engine runs eagerly while it records (no CUDA graphs, no multi-step greedy runs): each
forward's routing is copied out on the device right after it, which a captured graph would
need static buffers for.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn

from tessera.inference.scheduler import ScheduledRow
from tessera.models.moe import MoELayer
from tessera.models.router import Router


def moe_routers(model: nn.Module) -> list[Router]:
    """The routers of a model's MoE layers, first layer first."""
    return [module.router for module in model.modules() if isinstance(module, MoELayer)]


def expert_id_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds expert ids and the -1 of 'not recorded'."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


class RoutingRecorder:
    """Records the routing of every forward the engine runs into the requests it ran."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("routing is recorded for models with MoE layers only")
        self.dtype = expert_id_dtype(self.routers[0].num_experts)

    @contextlib.contextmanager
    def recording(self, rows: Sequence[ScheduledRow]) -> Iterator[None]:
        """Around one forward of `rows`, whose tokens it runs in this order."""
        for router in self.routers:
            router.recorded = []
        try:
            yield
            (experts,) = zip(*(router.recorded for router in self.routers))   # one forward: [T, k] per layer
            self._store(rows, torch.stack(experts, dim=1).to(self.dtype))
        finally:
            for router in self.routers:
                router.recorded = None

    def _store(self, rows: Sequence[ScheduledRow], experts: torch.Tensor) -> None:
        """Each row's slice of the forward's experts [T, layers, k] into its request, at its positions."""
        offset = 0
        for row in rows:
            request = row.request
            if request.routed_experts is None:
                length = len(request.prompt_token_ids) + request.params.max_tokens
                request.routed_experts = experts.new_full((length, *experts.shape[1:]), -1)
            request.routed_experts[row.start:row.start + row.count] = experts[offset:offset + row.count]
            offset += row.count

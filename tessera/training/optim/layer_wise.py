"""Distributed Muon (--optimizer muon --use-distributed-optimizer): whole matrices per rank.

Newton–Schulz needs a whole matrix, so Muon's state cannot be cut into the flat slices the
distributed optimizer gives each data-parallel rank (tessera.parallel.zero). Instead each rank
owns whole matrices: the Muon weights are dealt out largest first, each to the rank with the
fewest elements so far, and a rank keeps momentum for its own matrices only. The gradients of
the Muon weights are all-reduced (their own gradient buffer, tessera.parallel.ddp), each rank
steps the matrices it owns, and one all-gather gives every rank the others' new weights. This
is Megatron-LM's layer-wise distributed optimizer
(megatron/core/optimizer/layer_wise_optimizer.py, LayerWiseDistributedOptimizer), which also
all-reduces and all-gathers; AdamW's weights stay in the distributed optimizer.

Each rank computes exactly what one process would for the matrices it owns, so the result
does not depend on the data-parallel size. Under tensor parallelism the TP ranks of one data-
parallel rank own the same matrices and gather them over TP (tessera.training.optim.muon);
expert weights are dealt over expert data parallelism, the ranks holding the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.parallel.collectives import all_gather_flat
from tessera.training.optim.muon import Muon


def deal_matrices(params: list[nn.Parameter], ranks: int) -> list[list[nn.Parameter]]:
    """The parameters each of `ranks` owns: largest (full size) first, each to the least loaded
    rank (the lowest on ties). Every rank computes the same answer from the same model."""
    owner: dict[int, int] = {}
    load = [0] * ranks
    for param in sorted(params, key=lambda p: -_full_numel(p)):   # stable: the model's order on ties
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[id(param)] = rank
        load[rank] += _full_numel(param)
    return [[p for p in params if owner[id(p)] == rank] for rank in range(ranks)]   # each in the model's order


def _full_numel(param: nn.Parameter) -> int:
    spec = getattr(param, "shard_spec", None)
    return torch.Size(spec.full_shape).numel() if spec is not None else param.numel()


class LayerWiseMuon(Muon):
    """Muon over the matrices this rank owns, then an all-gather of everyone's new weights.

    `domains`: (parameters, the data-parallel group they are replicated over) pairs: the dense
    weights over data parallelism, the experts' over expert data parallelism."""

    def __init__(self, domains: list[tuple[list[nn.Parameter], object]], **options):
        self._shares = []   # (group, each rank's parameters) per domain with more than one rank
        owned = []
        for params, group in domains:
            ranks = dist.get_world_size(group) if group is not None else 1
            dealt = deal_matrices(params, ranks)
            owned += dealt[dist.get_rank(group) if group is not None else 0]
            if ranks > 1:
                self._shares.append((group, dealt))
        super().__init__(owned, **options)

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        stepped = super().step()
        if stepped:
            for group, dealt in self._shares:
                _share(group, dealt)
        return stepped


def _share(group, dealt: list[list[nn.Parameter]]) -> None:
    """Every rank's weights from their owners: one all-gather of each rank's owned weights,
    packed flat and padded to the largest rank's."""
    rank = dist.get_rank(group)
    sizes = [sum(p.numel() for p in params) for params in dealt]
    width = max(sizes)
    mine = dealt[rank][0] if dealt[rank] else next(p for params in dealt for p in params)
    packed = torch.zeros(width, dtype=mine.dtype, device=mine.device)
    if dealt[rank]:
        packed[:sizes[rank]] = torch.cat([p.detach().flatten() for p in dealt[rank]])
    gathered = torch.empty(width * len(dealt), dtype=packed.dtype, device=packed.device)
    all_gather_flat(gathered, packed, group=group)
    for owner, params in enumerate(dealt):
        if owner == rank:
            continue
        offset = owner * width
        for param in params:
            param.copy_(gathered[offset:offset + param.numel()].view_as(param))
            offset += param.numel()

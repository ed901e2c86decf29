"""LoRA: trainable low-rank updates on the frozen model's linear layers (Hu et al. 2021,
arXiv:2106.09685), under tensor, sequence, pipeline and expert parallelism.

    paths = apply_lora(model, posttrain, seed)   # adapters on the targeted layers; everything else frozen
    with adapters_off(model):                    # the base model, e.g. DPO's reference
        reference_logits = model(input_ids)
    state = adapter_state(model)                 # the trainable parameters by name (adapter-only checkpoints)
    merge_lora(model)                            # W += alpha/r B A in every adapted layer: plain layers again
    store_base_in_bf16(model)                    # --bf16: the frozen GEMM weights held as autocast casts them

An adapted layer computes base(x) + alpha/r * B(A(dropout(x))), with dropout on the adapter's
input only, as PEFT and Megatron-Bridge (dropout_position "pre") do. B starts at zero, so the
model at step 0 is the base model; A is drawn as Megatron-Bridge's default (xavier normal:
N(0, 2 / (in + r))) through tessera's initialize_parameters, from (seed, parameter name): the
same full A for any layout, and initialize_parameters run after apply_lora draws the same.

The adapter is a module in the adapted layer's `adapter` slot (tessera.parallel.tensor; a MoE
layer's experts have `fc1_adapter` and `fc2_adapter`): the layer keeps its class, its parameters
and their names, so checkpoints, FP8 GEMMs, --tp-comm-overlap and FSDP2 see the base as without
LoRA. One adapter class serves both cuts (Megatron-Bridge's ParallelLinearAdapter, the same layout):

    column-parallel base (qkv, fc1)  A [r, in] replicated, B [out / TP, r] cut as the base's rows
        (fused q/k/v blocks and replicated KV groups alike): A runs on the layer's own input (under
        sequence parallelism this rank's tokens), and its r-wide output is what is all-gathered
        along the sequence: r / hidden of the traffic of gathering the input again.
    row-parallel base (proj, fc2)    A [r, in / TP] on this rank's input features, its partial
        products summed over TP (all-reduce, or reduce-scatter to sequence shards), B [out, r]
        replicated.
    MoE experts (fc1, fc2)           A [experts, r, in], B [experts, out, r]: every expert its own,
        split over expert-parallel ranks as the experts are, through the experts' grouped GEMMs.

Replicated parameters that see only this rank's tokens under sequence parallelism (A of a
column-parallel layer, B of a row-parallel one) are marked `sequence_parallel`, so their
gradients are summed after backward as the norms' are (allreduce_sequence_parallel_grads).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn

from tessera.config import ConfigError
from tessera.config.posttrain import PostTrainConfig
from tessera.models.gpt import initialize_parameter
from tessera.models.moe import GroupedExperts
from tessera.parallel.random import DropoutRNG, dropout
from tessera.parallel.sharding import ShardSpec, annotate, sum_replica_grads
from tessera.parallel.tensor import (
    ColumnParallelLinear, RowParallelLinear, copy_to_tp_region, gather_from_sequence_region, reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)
from tessera.posttrain.lora_targets import Site, select_sites, sites

ADAPTER_PARAMETERS = ("lora_A", "lora_B")


def _parameter(spec: ShardSpec, like: torch.Tensor, **init) -> nn.Parameter:
    """This rank's shard of a new parameter cut by `spec`, on `like`'s device and dtype."""
    shape = spec.shard(torch.empty(spec.full_shape, device="meta")).shape
    return annotate(nn.Parameter(torch.empty(shape, device=like.device, dtype=like.dtype)), spec, **init)


def _xavier_std(in_features: int, rank: int) -> float:
    return math.sqrt(2.0 / (in_features + rank))


class _Adapter(nn.Module):
    """What every adapter has: its scale (alpha / r), dropout, switch and merged update."""

    def __init__(self, scale: float, dropout_p: float, rng: DropoutRNG | None):
        super().__init__()
        self.scale, self.dropout_p, self.rng = scale, dropout_p, rng
        self.enabled = True   # adapters_off switches it

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.dropout_p, self.training, self.rng)

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """alpha / r * B A in fp32, cut as the adapted weight is on this rank (B A is local either way:
        a column-parallel B holds this rank's rows and A is whole; a row-parallel A holds its columns)."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())


class LoRAAdapter(_Adapter):
    """The low-rank update of one ColumnParallelLinear or RowParallelLinear, cut as the layer is."""

    def __init__(self, layer: nn.Module, rank: int, scale: float, dropout_p: float, rng: DropoutRNG | None):
        spec = layer.weight.shard_spec
        out_features, in_features = spec.full_shape
        tp = dict(rank=spec.rank, size=spec.size)
        column = isinstance(layer, ColumnParallelLinear)
        # Dropout on an input split over TP ranks draws per-rank masks (tessera.parallel.random).
        split_input = layer.sequence_parallel if column else spec.size > 1
        super().__init__(scale, dropout_p, rng if split_input else None)
        self.column, self.tp_group, self.sequence_parallel = column, layer.tp_group, layer.sequence_parallel
        std = _xavier_std(in_features, rank)
        if self.column:
            self.lora_A = _parameter(ShardSpec((rank, in_features), None, None, **tp), layer.weight, init_std=std,
                                     sequence_parallel=layer.sequence_parallel)
            self.b_spec = ShardSpec((out_features, rank), 0, spec.segments, splits=spec.splits, **tp)
            self.lora_B = _parameter(self.b_spec, layer.weight)
        else:
            self.lora_A = _parameter(ShardSpec((rank, in_features), 1, None, **tp), layer.weight, init_std=std)
            self.lora_B = _parameter(ShardSpec((out_features, rank), None, None, **tp), layer.weight,
                                     sequence_parallel=layer.sequence_parallel)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + alpha/r B A dropout(x): x the layer's input on this rank, y its output."""
        if not self.enabled:
            return y
        h = nn.functional.linear(self._dropout(x), self.lora_A)
        group = self.tp_group
        if self.column:
            h = gather_from_sequence_region(h, group) if self.sequence_parallel else copy_to_tp_region(h, group)
            # A KV group replicated on several ranks: its rows of B are summed over them, as the base's are.
            delta = nn.functional.linear(h, sum_replica_grads(self.lora_B, self.b_spec, group))
        else:
            h = reduce_scatter_to_sequence_region(h, group) if self.sequence_parallel \
                else reduce_from_tp_region(h, group)
            delta = nn.functional.linear(h, self.lora_B)
        return y + delta * self.scale


class ExpertsLoRA(_Adapter):
    """Low-rank updates of one of a MoE layer's grouped GEMMs (fc1 or fc2): one per expert."""

    def __init__(self, weight: nn.Parameter, rank: int, scale: float, dropout_p: float, rng: DropoutRNG | None,
                 path: str):
        spec = weight.shard_spec
        if spec.size > 1:
            raise ConfigError(f"--lora-target-modules: {path} is cut by --expert-tensor-parallel-size "
                              f"{spec.size}; LoRA on the experts needs it 1 (or exclude them: "
                              f"--lora-exclude-modules '*.experts.*')")
        super().__init__(scale, dropout_p, rng)   # each rank's rows are its own tokens
        experts, out_features, in_features = spec.full_shape
        cut = dict(expert_rank=spec.expert_rank, expert_size=spec.expert_size)
        self.lora_A = _parameter(ShardSpec((experts, rank, in_features), **cut), weight,
                                 init_std=_xavier_std(in_features, rank), is_expert=True)
        self.lora_B = _parameter(ShardSpec((experts, out_features, rank), **cut), weight, is_expert=True)

    def forward(self, x: torch.Tensor, y: torch.Tensor, gemm) -> torch.Tensor:
        """y + alpha/r B_e A_e dropout(x) for the rows x of each expert e, through the experts' `gemm`."""
        if not self.enabled:
            return y
        h = gemm(self._dropout(x), self.lora_A.to(x.dtype))
        return y + gemm(h, self.lora_B.to(x.dtype)) * self.scale


def _adapter_slot(site: Site) -> str:
    return "adapter" if site.weight is None else f"{site.weight}_adapter"


def _attach(site: Site, rank: int, scale: float, dropout_p: float, rng: DropoutRNG | None) -> _Adapter:
    if site.weight is None:
        adapter = LoRAAdapter(site.module, rank, scale, dropout_p, rng)
    else:
        adapter = ExpertsLoRA(getattr(site.module, site.weight), rank, scale, dropout_p, rng, site.path)
    setattr(site.module, _adapter_slot(site), adapter)
    return adapter.train(site.module.training)   # dropout on only when the model trains


def apply_lora(model: nn.Module, posttrain: PostTrainConfig, seed: int) -> list[str]:
    """Put adapters on the layers --lora-target-modules names (less --lora-exclude-modules) and freeze
    everything else; the adapted layers' module paths (those of this pipeline stage).

    `model` is a GPTModel for any TP rank and pipeline stage (or a module holding tessera's TP
    layers), before torch.compile, FSDP2 or DDP wrap it: parameter names seed A, as in
    initialize_parameters. Adapters take the dtype and device of the weights they adapt.
    """
    if not posttrain.lora:
        raise ConfigError("LoRA adapters need --lora-rank")
    return attach_adapters(model, select_sites(model, posttrain.lora_target_modules,
                                               posttrain.lora_exclude_modules),
                           posttrain.lora_rank, posttrain.lora_scale, posttrain.lora_dropout, seed)


def attach_adapters(model: nn.Module, targets: list[Site], rank: int | dict[str, int], scale: float,
                    dropout_p: float, seed: int) -> list[str]:
    """apply_lora for given sites: `rank` one for all, or by site path (an imported PEFT adapter's)."""
    if adapters(model):
        raise ConfigError("this model has LoRA adapters already (apply_lora runs once)")
    rng = getattr(model, "dropout_rng", None)
    for param in model.parameters():
        param.requires_grad_(False)
    attached = [_attach(site, rank if isinstance(rank, int) else rank[site.path], scale, dropout_p, rng)
                for site in targets]
    new = {param for adapter in attached for param in adapter.parameters()}
    for name, param in model.named_parameters():
        if param in new:
            initialize_parameter(param, name, seed)
    if dropout_p > 0 and any(adapter.rng is not None for adapter in attached):
        model.recompute_rng = rng   # full recompute replays the per-rank dropout stream
    return [site.path for site in targets]


def adapters(model: nn.Module) -> dict[str, _Adapter]:
    """The model's adapters, by the path of the layer each adapts."""
    return {site.path: getattr(site.module, _adapter_slot(site)) for site in sites(model)
            if getattr(site.module, _adapter_slot(site)) is not None}


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter `name` (as model.named_parameters() gives it) is an adapter's."""
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMETERS


def adapter_state(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters (this rank's shards, each with its `shard_spec`) by parameter name:
    the trainable parameters, and all an adapter-only checkpoint needs beside the base's."""
    return {name: param for name, param in model.named_parameters() if is_adapter_parameter(name)}


@contextmanager
def adapters_off(model: nn.Module):
    """The base model for the forward passes inside: every adapter switched off, then back as it was.

    A backward of those passes must run inside too, when activation recomputation replays them.
    """
    switched = list(adapters(model).values())
    states = [adapter.enabled for adapter in switched]
    for adapter in switched:
        adapter.enabled = False
    try:
        yield model
    finally:
        for adapter, state in zip(switched, states):
            adapter.enabled = state


@torch.no_grad()
def store_base_in_bf16(model: nn.Module) -> list[str]:
    """Store the frozen base's GEMM weights in bf16 (LoRA under --bf16); the names of those stored.

    Autocast caches its bf16 copy only of a weight that trains: a frozen fp32 weight is cast again in
    every forward pass and its copy saved for the backward, the base held twice (4 + 2 bytes a weight).
    Stored as autocast casts it, the layers compute the same (a bf16 weight passes autocast unchanged)
    in 2 bytes a weight. Stored: the linear layers' weights, the experts' grouped weights and an output layer of its
    own. Kept: the adapters (they train), norms, biases, the router, and the input embedding (a lookup,
    whose fp32 output keeps the residual stream fp32), with an output layer tied to it. Each stored
    weight is marked `stored_bf16` (tessera.training.build.activation_dtype looks past them).
    """
    weights = [module.weight for module in model.modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear, nn.Linear))]
    weights += [w for module in model.modules() if isinstance(module, GroupedExperts) for w in (module.fc1, module.fc2)]
    weights.append(getattr(model, "output_weight", None))   # None when tied to the embedding
    chosen = {id(w) for w in weights if w is not None and not w.requires_grad and w.dtype == torch.float32}
    stored = []
    for name, param in model.named_parameters():
        if id(param) in chosen:
            param.data = param.data.to(torch.bfloat16)
            param.stored_bf16 = True
            stored.append(name)
    return stored


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into the weight it adapts (W += alpha/r B A, each rank its own shard: no
    communication, no shard mixed with another's) and remove it; the merged layers' paths.

    The base's parameters stay frozen. FP8-stored weights and FSDP2-sharded ones are refused:
    merge in the model's own dtype, before FSDP2 shards it (or after gathering).
    """
    merged = []
    for site in sites(model):
        adapter = getattr(site.module, _adapter_slot(site))
        if adapter is None:
            continue
        weight = getattr(site.module, site.weight or "weight")
        if hasattr(weight, "to_local") or weight.dtype.itemsize == 1:
            raise ConfigError(f"{site.path}: LoRA merges into plain bf16/fp16/fp32 weights, not "
                              f"{'FSDP2-sharded' if hasattr(weight, 'to_local') else 'FP8'} ones")
        weight.copy_((weight.float() + adapter.update()).to(weight.dtype))
        setattr(site.module, _adapter_slot(site), None)
        merged.append(site.path)
    return merged

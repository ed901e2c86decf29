"""PyTorch FSDP2 for --data-parallel-sharding-strategy optim_grads_params (ZeRO-3,
--use-torch-fsdp2) and optim_grads (--torch-fsdp2-no-reshard-after-forward).

`fully_shard` wraps each transformer block and then the root (embeddings, final norm, output
layer). It shards the tensor-parallel shards it is given, so TP x FSDP composes: the TP layers
split the maths, FSDP2 splits the storage along the data-parallel dimension only.

What the two strategies hold on each rank (FSDP2's `reshard_after_forward`):

- optim_grads_params: a block's weights are gathered for its forward, freed, and gathered
  again for its backward: about one block's full weights at a time, two all-gathers per
  micro-batch.
- optim_grads: a block's gathered weights stay from its forward to its backward, so at the
  peak (the end of the forward) every block's full weights are held, in the compute dtype, as
  ZeRO-2 holds them; one all-gather per micro-batch. Gradients are still reduce-scattered
  block by block into 1/DP shards and the optimizer state is 1/DP, and between steps the
  weights are back to their 1/DP shards: ZeRO-2's peak memory and traffic, ZeRO-3's memory
  at rest. A ZeRO-2 built into the distributed optimizer instead would need its flat gradient
  buffer (tessera.parallel.ddp) cut per bucket and freed after each reduce-scatter, and a
  reduce-scatter in every micro-batch, which is what FSDP2 already does.

HSDP (--num-distributed-optimizer-instances N): each block is sharded over a replica's
DP / N ranks and replicated over the N replicas (FSDP2's 2-D mesh, Mesh.fsdp_mesh):
gradients are reduce-scattered within a replica, then all-reduced across replicas.

With expert parallelism a MoE layer's experts are wrapped first, on their own: they are
sharded and reduced over expert data parallelism (the ranks holding the same experts),
the rest of the block over data parallelism.

With --bf16 the shards stay fp32 (the optimizer's masters) and FSDP2 gathers them in bf16 for the
forward and backward, and reduce-scatters the gradients in fp32 (its MixedPrecisionPolicy): the
weights the layers compute with are those autocast would cast, in half the bytes of an fp32
gather. With --fp8-param-gather the FP8 linears' weights are gathered in E4M3 (tessera.parallel.fsdp_fp8).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from tessera.parallel.fsdp_fp8 import wrap_fp8_weights
from tessera.parallel.mesh import Mesh


def apply_fsdp2(model: nn.Module, mesh: Mesh, *, param_dtype: torch.dtype | None = None,
                fp8_weights: Collection[nn.Parameter] = ()) -> nn.Module:
    """Shard `model` as mesh.sharding_strategy says. `param_dtype`: the dtype the weights are
    gathered in (None: theirs); `fp8_weights` (--fp8-param-gather): the FP8 linears' weights,
    gathered in E4M3 (tessera.parallel.fsdp_fp8)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = dict(reshard_after_forward=mesh.sharding_strategy != "optim_grads",
                   mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))

    dp_mesh = mesh.fsdp_mesh
    # fully_shard replaces every parameter by a new DTensor parameter: carry over what the
    # rest of tessera attached to the old ones (ShardSpec, sequence-parallel marks, ...).
    attributes = {name: dict(param.__dict__) for name, param in model.named_parameters()}
    wrap_fp8_weights(model, set(fp8_weights))
    units = []
    if not mesh.experts_follow_data_parallel:   # experts have replicas of their own
        units = [moe.experts for moe in model.moe_layers().values()]
        for experts in units:
            fully_shard(experts, mesh=mesh.expert_mesh["edp"], **options)
    units += list(model.layers)
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh, **options)
    fully_shard(model, mesh=dp_mesh, **options)
    # The trainer divides each rank's loss by the tokens of the whole global batch, so the
    # gradients must be summed over ranks, not averaged (FSDP2's default).
    for module in [*units, model]:
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
        else:  # older torch
            module.set_reduce_scatter_divide_factor(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    for name, param in model.named_parameters():
        param.__dict__.update(attributes.get(name, {}))
    return model

"""ZeRO-3 through PyTorch FSDP2 (--use-torch-fsdp2): parameters, gradients and optimizer
state sharded over the data-parallel ranks.

`fully_shard` wraps each transformer block (one all-gather per block in forward and
backward, freed after use) and then the root (embeddings, final norm, output layer).
It shards the tensor-parallel shards it is given, so TP x FSDP composes: the TP layers
split the maths, FSDP2 splits the storage along the data-parallel dimension only.

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


def apply_fsdp2(model: nn.Module, mesh: Mesh, *, reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, fp8_weights: Collection[nn.Parameter] = ()) -> nn.Module:
    """`param_dtype`: the dtype the weights are gathered in (None: theirs); `fp8_weights`
    (--fp8-param-gather): the FP8 linears' weights, gathered in E4M3 (tessera.parallel.fsdp_fp8)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options = dict(reshard_after_forward=reshard_after_forward,
                   mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))

    # Context-parallel ranks hold other tokens of the same samples: their gradients are summed
    # and their shards split over data x context parallelism, as the DDP buffers are.
    dp_mesh = mesh.submesh("dp_cp" if mesh.cp_size > 1 else "dp")
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

"""Muon (--optimizer muon): momentum orthogonalised by Newton–Schulz, for the hidden matrices.

What Muon steps (`muon_parameters`): the weights of the transformer's linear layers (attention
and MLP projections, MLA's down and up projections, MTP's projection, Mamba's output projection)
and the MoE experts' stacked weights, one matrix per expert. Everything else (word and position
embeddings, the output layer, norms, biases, routers and gates, Mamba's convolution and its
input projection, whose five parts are not one map's matrices) is AdamW's, as Megatron-LM's
Muon routes them (megatron/core/optimizer/emerging_optimizers.py, _is_muon_excluded; the
`use_muon=False` of megatron/core/ssm/mamba_mixer.py), as Moonlight does (arXiv 2502.16982) and
torch.optim.Muon's documentation asks.

Fused weights are orthogonalised as the matrices the unfused model would hold: the fused
QKV projection as its Q, K and V (Megatron's default; --muon-no-split-qkv orthogonalises it
whole) and the SwiGLU gate/up projection as gate and up, always. Orthogonalising a fused weight
whole would couple the blocks' singular values, so that Q's update shrank where K's gradient is
large: the update would depend on how the code happens to store the weights, not on the model.
(Megatron-LM orthogonalises its fused gate/up `linear_fc1` whole; the blocks are the rows of
each segment of the weight's ShardSpec.)

Under tensor parallelism each matrix is orthogonalised whole: the momentum's TP shards are
gathered (the expert-TP ones for experts), every TP rank runs the same iteration on the full
matrix and keeps its shard of the result (Megatron's --muon-tp-mode duplicated), so the step
is the one-process step whatever the layout.

One step of a matrix W with gradient G, as torch.optim.Muon's (momentum `mu`, learning rate
`lr`, weight decay `wd`, Newton–Schulz `NS`, scale `s` of tessera.training.optim.newton_schulz):

    B <- mu B + (1 - mu) G;  U <- mu B + (1 - mu) G if nesterov else B
    W <- W (1 - lr wd) - lr s NS(U)

The gradient arrives still loss-scaled and unclipped: `grad_scale` (the loss scale over the
clip factor) divides it first, and `found_inf` skips the step, as the fused AdamW kernel reads
them (tessera.training.optimizer.TrainingOptimizer.step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import OptimConfig
from tessera.parallel.sharding import ShardSpec
from tessera.training.optim.newton_schulz import coefficient_schedule, orthogonalize, update_scale


@dataclass(frozen=True)
class MatrixLayout:
    """How one parameter's local tensor is part of the matrices Muon orthogonalises."""

    spec: ShardSpec            # its cut over tensor parallelism
    group: object = None       # the TP (or expert-TP) group its shards are gathered over
    split: bool = False        # orthogonalise each fused block (spec.segments) on its own

    @classmethod
    def whole(cls, param: torch.Tensor) -> "MatrixLayout":
        return cls(ShardSpec(tuple(param.shape)))


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable weights Muon steps, in the model's order: linear layers' weights and the MoE
    experts' stacked weights (see the module docstring for what is left to AdamW)."""
    from tessera.models.mamba import MambaMixer
    from tessera.models.moe import GroupedExperts
    from tessera.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    chosen, excluded = [], set()
    for module in model.modules():
        if isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)):
            chosen.append(module.weight)
        elif isinstance(module, GroupedExperts):
            chosen += [module.fc1, module.fc2]
        elif isinstance(module, MambaMixer):
            excluded.add(id(module.in_proj.weight))
    return [param for param in chosen if param.requires_grad and id(param) not in excluded]


def matrix_layouts(model: nn.Module, params: list[nn.Parameter], optim: OptimConfig, mesh) -> dict:
    """Each parameter's MatrixLayout in `model` on `mesh`."""
    from tessera.models.attention import Attention

    qkv = {id(module.qkv.weight) for module in model.modules() if isinstance(module, Attention)}
    layouts = {}
    for param in params:
        spec = getattr(param, "shard_spec", None) or ShardSpec(tuple(param.shape))
        split = bool(spec.segments) and not (id(param) in qkv and optim.muon_no_split_qkv)
        group = mesh.group("etp") if getattr(param, "is_expert", False) else mesh.tp_group
        layouts[param] = MatrixLayout(spec, group, split)
    return layouts


def muon_options(optim: OptimConfig) -> dict:
    """Muon's keyword arguments from the --muon-* flags."""
    return dict(lr=optim.lr, weight_decay=optim.weight_decay, momentum=optim.muon_momentum,
                nesterov=optim.muon_nesterov, coefficient_type=optim.muon_coefficient_type,
                ns_steps=optim.muon_num_ns_steps, precision=optim.muon_fp32_matmul_prec,
                scale_mode=optim.muon_scale_mode, extra_scale=optim.muon_extra_scale_factor)


class Muon(torch.optim.Optimizer):
    """Muon over 2-D weights (or stacks of them: MoE experts), sharded over TP as `layouts` say."""

    def __init__(self, params, *, layouts: dict | None = None, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = False, coefficient_type: str = "quintic", ns_steps: int = 5,
                 precision: str = "medium", scale_mode: str = "spectral", extra_scale: float = 1.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov))
        self.layouts = layouts or {}
        self.schedule = coefficient_schedule(coefficient_type, ns_steps)
        self.precision, self.scale_mode, self.extra_scale = precision, scale_mode, extra_scale
        self.grad_scale: torch.Tensor | None = None   # set by the caller before each step
        self.found_inf: torch.Tensor | None = None

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def momentum(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def state_bytes(self) -> int:
        return sum(4 * p.numel() for p in self.params)

    @torch.no_grad()
    def step(self, closure=None) -> bool:
        """One update of every parameter with a gradient; False when skipped (found_inf)."""
        if self.found_inf is not None and self.found_inf.item():
            return False
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if self.grad_scale is None else param.grad / self.grad_scale
                buffer = self.momentum(param)
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                blocks = self._orthogonal_blocks(param, update)
                param.mul_(1 - lr * group["weight_decay"])
                for target, orthogonal, scale in blocks:
                    target.add_(orthogonal, alpha=-lr * scale)
        return True

    def _orthogonal_blocks(self, param: torch.Tensor, update: torch.Tensor
                           ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """(view of `param`, its orthogonalised update, the update's scale) for each matrix block."""
        layout = self.layouts.get(param) or MatrixLayout.whole(param)
        spec, dim = layout.spec, layout.spec.dim
        full = _gather(update, layout)
        segments = spec.segments if layout.split else None
        pieces = full.split(list(segments), dim=dim) if segments else [full]
        results = [orthogonalize(piece, self.schedule, self.precision) for piece in pieces]
        scales = [update_scale(piece.size(-2), piece.size(-1), self.scale_mode, self.extra_scale) for piece in pieces]
        local = _local_shard(torch.cat(results, dim=dim) if segments else results[0], layout)
        if not segments:
            return [(param, local, scales[0])]
        return [(param.narrow(dim, p.local_start, p.length), local.narrow(dim, p.local_start, p.length), scale)
                for p, scale in zip(spec.pieces(), scales)]


def _gather(local: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """The whole matrix (this rank's experts) from every TP rank's shard."""
    if layout.group is None or layout.spec.replicated:
        return local
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(layout.group))]
    dist.all_gather(shards, local.contiguous(), group=layout.group)
    return layout.spec.unshard(shards)


def _local_shard(full: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """This rank's TP shard of a whole matrix laid out as _gather returns it."""
    if layout.group is None or layout.spec.replicated:
        return full
    spec = layout.spec
    return dataclasses.replace(spec, full_shape=spec.tp_full_shape, expert_rank=0, expert_size=1).shard(full)

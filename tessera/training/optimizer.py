"""AdamW, SGD or Muon over any data-parallel layout, with one global gradient norm.

--optimizer adam steps every parameter with AdamW, sgd with SGD (momentum --sgd-momentum, L2
weight decay, as Megatron-LM's), muon the hidden layers' matrices with Muon and the rest with
AdamW (tessera.training.optim.muon). With --optimizer-cpu-offload the distributed optimizer's
state lives in host memory and is streamed through the device for each step
(tessera.training.optim.offload). `build_optimizer` picks how gradients are reduced and
weights updated:

    local       one process, or DDP (--data-parallel-sharding-strategy no_shard): grads in a
                flat buffer, all-reduced (tessera.parallel.ddp)
    distributed strategy optim (--use-distributed-optimizer): reduce-scatter, step own slices
                (tessera.parallel.zero)
    fsdp2       strategies optim_grads and optim_grads_params (--use-torch-fsdp2): FSDP2
                reduce-scatters; every parameter is a DTensor shard (tessera.parallel.fsdp)

With --num-distributed-optimizer-instances N the sharded state has N copies (HSDP): the
distributed optimizer reduce-scatters over one replica's ranks and sums its slices over the
replicas (Megatron's partial distributed optimizer); FSDP2 shards over a 2-D mesh.

and returns a `TrainingOptimizer` the trainer drives the same way in all three. Norms and
biases (every 1-D parameter) get no weight decay, as in Megatron-LM.

Muon's matrices are stepped whole (tessera.training.optim.muon): in the local layouts every rank
steps them all, gathering TP shards; under --use-distributed-optimizer their gradients are all-
reduced in a buffer of their own and each data-parallel rank steps the whole matrices it owns
(tessera.training.optim.layer_wise), while AdamW's weights stay in the distributed optimizer.
FSDP2 shards every matrix over data-parallel ranks, so it takes --optimizer adam or sgd only.

MoE expert weights are reduced over their own group, expert data parallelism (the ranks
holding the same experts): they get a gradient buffer of their own, unless that group is
the data-parallel group itself (no expert parallelism, expert-TP = TP). With
--fp8-param-gather the FP8 linears' weights get one too (gathered in E4M3:
tessera.parallel.fp8_gather); under FSDP2 their shards are cast after each step for FSDP2's
gathers (tessera.parallel.fsdp_fp8).

The gradient norm counts every element of the model exactly once, summed over all ranks:
grads sharded over tensor-parallel ranks count their own elements; grads replicated over
TP (norms, row-parallel biases) count on TP rank 0 only; grads replicated over data-
parallel ranks count on the first replica, and those sharded over them (distributed
optimizer, FSDP2) each their own slice, on the first copy of the sharded state (HSDP);
expert weights likewise over expert parallelism and expert data parallelism; the word
embedding that the last pipeline stage also holds (tied, or MTP's input) counts on the
first stage only (after its gradient has been summed over the first and last stage).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import OptimConfig, ParallelConfig
from tessera.kernels.sum_of_squares import sum_of_squares
from tessera.parallel.ddp import GradBuffer, default_bucket_size
from tessera.parallel.fsdp_fp8 import Fp8Shards
from tessera.parallel.mesh import Mesh
from tessera.parallel.pipeline import PipelineGroups, sum_tied_grads
from tessera.parallel.sharding import allreduce_sequence_parallel_grads
from tessera.parallel.zero import DistributedOptimizer, adamw_groups
from tessera.training.optim.layer_wise import LayerWiseMuon
from tessera.training.optim.offload import offload_state
from tessera.training.optim.muon import Muon, matrix_layouts, muon_options, muon_parameters


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}   # --exp-avg-dtype, --exp-avg-sq-dtype


def _elementwise(params: list[torch.Tensor], optim: OptimConfig, decoupled: Collection[nn.Parameter]
                 ) -> torch.optim.Optimizer:
    """The fused AdamW (or, --optimizer sgd, SGD) of the parameters not in Muon's care."""
    groups = adamw_groups(((p, p) for p in params), optim.weight_decay, decoupled)
    if optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.sgd_momentum, fused=True)
    return torch.optim.AdamW(groups, lr=optim.lr, fused=True, betas=(optim.adam_beta1, optim.adam_beta2),
                             eps=optim.adam_eps)


def decoupled_parameters(model: nn.Module, optim: OptimConfig) -> set[nn.Parameter]:
    """The weights --decoupled-lr trains: the word embedding (each stage's copy) and the output
    layer, as Megatron-LM's is_embedding_or_output_parameter marks them."""
    if optim.decoupled_lr is None:
        return set()
    embedding = getattr(model, "embedding", None)
    return {weight for weight in (getattr(embedding, "weight", None), getattr(model, "output_weight", None))
            if weight is not None}


class TrainingOptimizer:
    """Zero grads, reduce them, measure their global norm, and step AdamW (SGD) and Muon."""

    def __init__(self, model: nn.Module, optim: OptimConfig, mesh: Mesh, *, buffers: list[GradBuffer],
                 inner, dp_sharded: bool, pipeline: PipelineGroups | None = None, fp8_shards: Fp8Shards | None = None,
                 muon: Muon | None = None):
        """`inner` steps every parameter that `muon` (--optimizer muon) does not. `fp8_shards`
        (--fp8-param-gather under FSDP2): cast to E4M3 now and after every step."""
        self.model, self.optim, self.mesh, self.buffers, self.inner = model, optim, mesh, buffers, inner
        self.muon = muon
        self.fp8_shards = fp8_shards
        self.cast_fp8_shards()
        self.dp_sharded = dp_sharded  # each rank holds only its slice of the reduced grads
        self.pipeline = pipeline
        self._buffer_of = {param: grads for grads in buffers for param in grads.ranges}
        # Under PP with tied embeddings or MTP the first and last stage each hold the word embedding.
        embedding = getattr(model, "embedding", None)
        self._tied = embedding.weight if pipeline is not None and embedding is not None \
            and model.config.last_stage_embedding else None
        self._norm_skips = self._tied if self._tied is not None and not model.pre_process else None

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for grads in self.buffers:
            grads.zero()
        if not self.buffers:
            for optimizer in self._optimizers():
                optimizer.zero_grad(set_to_none=True)

    def set_last_micro_batch(self, last: bool) -> None:
        for grads in self.buffers:
            grads.set_last_micro_batch(last)
        if last and getattr(self.inner, "offload", None) is not None:   # the step's first state, brought up
            self.inner.offload.prefetch()

    def main_grad(self, param: nn.Parameter) -> torch.Tensor | None:
        """The tensor holding `param`'s gradient (a view of its buffer, or .grad)."""
        grads = self._buffer_of.get(param)
        return grads.view(param) if grads is not None else _local(param.grad) if param.grad is not None else None

    def finish_grad_sync(self) -> None:
        """Finish the data-parallel reduction, then sum sequence-parallel partial gradients
        over TP (Megatron's order; both are sums, so only the data's location matters)."""
        for grads in self.buffers:
            grads.finish()
        main_grad = self.main_grad
        allreduce_sequence_parallel_grads(self.model, self.mesh.tp_group, main_grad=main_grad)
        if self._tied is not None:
            if isinstance(self.inner, DistributedOptimizer):
                slices = [(g, offset) for g, p, offset in self.inner.local_grads_with_offsets() if p is self._tied]
                group = self.pipeline.embedding_dp
            else:
                slices, group = [(main_grad(self._tied), 0)], self.pipeline.embedding
            sum_tied_grads(slices, self._tied.numel(), group, self._tied.device)

    def wait_for_parameters(self) -> None:
        """Wait for the distributed optimizer's parameter all-gathers: for whatever reads the
        weights other than through the model's forward, whose hooks wait module by module
        (pipeline stages, checkpoint saves)."""
        if isinstance(self.inner, DistributedOptimizer):
            self.inner.wait_all()

    def gather_model_weights(self) -> None:
        """Every rank's whole model in its own dtype (the caller of Trainer.train): waits for the
        gathers, and gathers the bf16 weights of those gathered in E4M3 (--fp8-param-gather)."""
        if isinstance(self.inner, DistributedOptimizer):
            self.inner.gather_model_weights()

    def _owned_grads(self) -> list[tuple[torch.Tensor, nn.Parameter, int | None]]:
        """(gradient this rank holds, its parameter, flat offset of a slice or None if whole)."""
        if isinstance(self.inner, DistributedOptimizer):
            return self.inner.local_grads_with_offsets() + [(self.main_grad(p), p, None) for p in self._layer_wise]
        return [(_local(p.grad), p, _fsdp_row_offset(p)) for p in self.model.parameters()
                if p.grad is not None]

    @property
    def _layer_wise(self) -> list[nn.Parameter]:
        """The matrices distributed Muon steps on this rank (each on one data-parallel rank only)."""
        return self.muon.params if isinstance(self.muon, LayerWiseMuon) else []

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (still loss-scaled) gradients; inf/nan on overflow."""
        plain, masked = [], []
        for grad, param, offset in self._owned_grads():
            if param is self._norm_skips:   # the embedding's copy on the last stage: counted on the first
                continue
            if not self._counted_here(param):
                continue
            spec = getattr(param, "shard_spec", None)
            mask = spec.counted_mask() if spec is not None else None
            if mask is None:
                plain.append(grad)
            elif mask.ndim == 0:          # replicated over TP: counted on TP rank 0 only
                if mask.item():
                    plain.append(grad)
            else:                         # some blocks (KV heads) replicated: count one copy
                # param.shape is this TP rank's whole shard, also for a DTensor or a slice.
                mask = mask.expand(param.shape).flatten()[offset or 0:][:grad.numel()]
                masked.append(grad.flatten() * mask.to(grad.device))
        squares = torch.zeros((), device=next(self.model.parameters()).device)
        if plain or masked:
            squares += sum_of_squares(plain + masked)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(squares)   # every element was counted on exactly one rank
        return squares.sqrt()

    def _counted_here(self, param: nn.Parameter) -> bool:
        """Whether this rank counts its gradient of `param` in the norm: each slice of sharded state
        on its first copy (HSDP), replicated gradients on the first of the data-parallel replicas
        holding them (for expert weights: of the expert-data-parallel replicas)."""
        mesh = self.mesh
        if self.dp_sharded:
            return mesh.dp_replica_rank == 0
        if getattr(param, "is_expert", False):
            return mesh.edp_rank == 0
        return mesh.dp_rank == 0 and mesh.cp_rank == 0

    @torch.no_grad()
    def step(self, norm: torch.Tensor, loss_scale: float, lr: float, decoupled_lr: float | None = None
             ) -> torch.Tensor:
        """Unscale, clip and update in the fused AdamW kernel; returns the unscaled norm.

        The fused kernel divides every gradient by `grad_scale` and skips the whole update
        when `found_inf` is set (the interface torch.amp.GradScaler uses). Folding the loss
        scale and the clip factor into it saves a pass over the gradients and needs no
        device-to-host sync. The norm is global, so every rank agrees on the skip.
        """
        norm = norm / loss_scale
        max_norm = self.optim.clip_grad
        clip = (max_norm / (norm + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(norm)
        found_inf, grad_scale = (~torch.isfinite(norm)).float(), loss_scale / clip
        for optimizer in self._optimizers():
            for group in optimizer.param_groups:
                group["lr"] = decoupled_lr if group.get("decoupled") else lr
            optimizer.found_inf, optimizer.grad_scale = found_inf, grad_scale
        self.inner.step()
        if self.muon is not None:
            self.muon.step()
        self.cast_fp8_shards()
        return norm

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that step: the elementwise one (inside the distributed optimizer
        when there is one), and Muon."""
        inner = self.inner.optimizer if isinstance(self.inner, DistributedOptimizer) else self.inner
        return [inner] + ([self.muon] if self.muon is not None else [])

    def cast_fp8_shards(self) -> None:
        """--fp8-param-gather under FSDP2: cast the FP8 linears' weight shards for FSDP2's next
        gathers (after every change of the weights: a step, a checkpoint load)."""
        if self.fp8_shards is not None:
            self.fp8_shards.quantize()

    @property
    def found_inf(self) -> torch.Tensor:
        return self._optimizers()[0].found_inf

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank (fp32 masters or their remainders kept apart from the
        model, Adam moments, SGD's and Muon's momentum)."""
        muon = self.muon.state_bytes() if self.muon is not None else 0
        if isinstance(self.inner, DistributedOptimizer):
            return self.inner.state_bytes() + muon
        per_element = 4 if self.optim.optimizer == "sgd" else 8
        others = {id(p) for p in self.muon.params} if self.muon is not None else set()
        return muon + per_element * sum(_local(p).numel() for p in self.model.parameters() if id(p) not in others)

    def host_state_bytes(self) -> int:
        """The part of `state_bytes` kept in host memory (--optimizer-cpu-offload)."""
        offload = getattr(self.inner, "offload", None)
        return offload.host_bytes() if offload is not None else 0


def build_optimizer(model: nn.Module, optim: OptimConfig, parallel: ParallelConfig, mesh: Mesh, *,
                    bf16: bool = False, pipeline: PipelineGroups | None = None, micro_batches: int = 1,
                    fp8_gathered: dict[nn.Parameter, nn.Module] | None = None) -> TrainingOptimizer:
    """The optimizer for the layout; call after the model is built (and FSDP2-wrapped).
    `fp8_gathered` (--fp8-param-gather): the weights the distributed optimizer gathers in E4M3,
    each with its FP8 GEMM module."""
    params = [p for p in model.parameters() if p.requires_grad]
    decoupled = decoupled_parameters(model, optim)
    matrices = muon_parameters(model) if optim.optimizer == "muon" else []
    in_muon = {id(p) for p in matrices}
    others = [p for p in params if id(p) not in in_muon]
    if parallel.use_torch_fsdp2:   # RunConfig refuses Muon here
        shards = Fp8Shards(fp8_gathered, torch.bfloat16 if bf16 else torch.float32) if fp8_gathered else None
        return TrainingOptimizer(model, optim, mesh, buffers=[], inner=_elementwise(params, optim, decoupled),
                                 dp_sharded=True, pipeline=pipeline, fp8_shards=shards)
    muon = dict(layouts=matrix_layouts(model, matrices, optim, mesh), **muon_options(optim))
    if mesh.dp_size * mesh.cp_size == 1 and mesh.edp_size == 1 and not parallel.use_distributed_optimizer:
        # Nothing to reduce: plain .grad tensors, freed rather than zeroed between steps.
        return TrainingOptimizer(model, optim, mesh, buffers=[], inner=_elementwise(others, optim, decoupled),
                                 dp_sharded=False, pipeline=pipeline, muon=Muon(matrices, **muon) if matrices else None)
    own_group = not mesh.experts_follow_data_parallel
    fp8_gathered = fp8_gathered or {}

    def expert(param: nn.Parameter) -> bool:
        return own_group and getattr(param, "is_expert", False)

    # Under HSDP (the distributed optimizer only: DDP has nothing to shard) one replica's ranks.
    dp_group, dp_size = mesh.dp_shard_group, mesh.dp_shard_size
    edp_group = mesh.group("edp")

    def buffer(members: list[nn.Parameter], group, size: int, reduce_scatter: bool) -> GradBuffer:
        return GradBuffer(
            members, group, bucket_size=parallel.ddp_bucket_size or default_bucket_size(size),
            overlap=parallel.overlap_grad_reduce, reduce_scatter=reduce_scatter,
            reduce_dtype=torch.bfloat16 if bf16 and not parallel.accumulate_allreduce_grads_in_fp32 else torch.float32,
            # Nothing to reduce or accumulate: the distributed optimizer reads autograd's gradients.
            stored=not (parallel.use_distributed_optimizer and group is None and micro_batches == 1),
            replica_group=mesh.group("dp_replicate") if reduce_scatter and group is dp_group else None)

    # Distributed Muon steps whole matrices: their gradients are all-reduced, in buffers of their own.
    apart = parallel.use_distributed_optimizer and bool(matrices)
    sharded = others if apart else params
    groups = [([p for p in sharded if not expert(p) and p in fp8_gathered], dp_group, dp_size),
              ([p for p in sharded if not expert(p) and p not in fp8_gathered], dp_group, dp_size),
              ([p for p in sharded if expert(p)], edp_group, mesh.edp_size)]
    buffers = [buffer(members, group, size, parallel.use_distributed_optimizer)
               for members, group, size in groups if members]
    if not parallel.use_distributed_optimizer:
        return TrainingOptimizer(model, optim, mesh, buffers=buffers, inner=_elementwise(others, optim, decoupled),
                                 dp_sharded=False, pipeline=pipeline,
                                 muon=Muon(matrices, **muon) if matrices else None)
    inner = DistributedOptimizer(model, buffers, optim, param_dtype=torch.bfloat16 if bf16 else torch.float32,
                                 overlap_param_gather=parallel.overlap_param_gather,
                                 moment_dtypes=(_DTYPES[optim.exp_avg_dtype], _DTYPES[optim.exp_avg_sq_dtype]),
                                 master_remainders=optim.use_precision_aware_optimizer, fp8_layers=fp8_gathered,
                                 decoupled=decoupled)
    if optim.optimizer_cpu_offload:
        inner.offload = offload_state(inner, optim.optimizer_offload_fraction)
    domains = [([p for p in matrices if not expert(p)], dp_group, dp_size),
               ([p for p in matrices if expert(p)], edp_group, mesh.edp_size)] if apart else []
    domains = [(members, group, size) for members, group, size in domains if members]
    muon_buffers = [buffer(members, group, size, reduce_scatter=False) for members, group, size in domains]
    return TrainingOptimizer(model, optim, mesh, buffers=buffers + muon_buffers, inner=inner, dp_sharded=True,
                             pipeline=pipeline, muon=LayerWiseMuon([(m, g) for m, g, _ in domains], **muon)
                             if domains else None)


def _fsdp_row_offset(param: nn.Parameter) -> int | None:
    """Flat offset of this rank's FSDP2 shard in the TP shard (FSDP2 cuts dim 0), or None for a
    whole tensor."""
    if not hasattr(param, "to_local"):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, origin = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return origin[0] * (param.numel() // max(param.shape[0], 1))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor

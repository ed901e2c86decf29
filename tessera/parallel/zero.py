"""The distributed optimizer (ZeRO-1, --use-distributed-optimizer).

Each data-parallel rank owns 1/DP of every gradient bucket (tessera.parallel.ddp). After
the reduce-scatter it holds the summed gradients of its slices; it keeps fp32 master
weights and Adam moments for those slices only, steps them, and all-gathers the updated
weights so that every rank has the full model for the next forward.

A MoE model has two gradient buffers: the dense parameters' over data parallelism and
the experts' over expert data parallelism (the ranks holding the same experts). Each is
sharded over its own group; one AdamW steps the slices of both.

Model parameters live in one flat buffer laid out exactly like the gradient buffer, so a
rank's slice of the weights is a contiguous view. With --bf16 the model's weights are
bf16 (no casts in the forward pass, half the all-gather traffic) and the optimizer keeps
separate fp32 masters, or with --use-precision-aware-optimizer only their lower halves, the
weights being the upper ones (tessera.kernels.adamw.split_master); in fp32 runs the weights
are their own masters.

With --overlap-param-gather the all-gathers start right after the step, and each module
waits for its bucket only when the next forward reaches it. With --fp8-param-gather the
buffers of FP8 linears' weights are gathered in E4M3 (tessera.parallel.fp8_gather).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
from torch import nn

from tessera.config import OptimConfig
from tessera.kernels.adamw import MasterAdamW, join_master, split_master
from tessera.parallel.collectives import all_gather_flat
from tessera.parallel.ddp import GradBuffer
from tessera.parallel.fp8_gather import Fp8Weights


def adamw_groups(members: Iterable[tuple[torch.Tensor, nn.Parameter]], weight_decay: float,
                 decoupled: Collection[nn.Parameter] = ()) -> list[dict]:
    """AdamW's parameter groups of the tensors it steps (a parameter, or a slice of one): norms
    and biases (1-D parameters) get no weight decay, as in Megatron-LM; the parameters in
    `decoupled` are marked to train at --decoupled-lr (TrainingOptimizer.step sets each group's)."""
    decoupled_ids = {id(param) for param in decoupled}
    groups: dict[tuple[bool, bool], list[torch.Tensor]] = {}
    for tensor, param in members:
        groups.setdefault((id(param) in decoupled_ids, param.ndim > 1), []).append(tensor)
    return [{"params": tensors, "weight_decay": weight_decay if decayed else 0.0, "decoupled": is_decoupled}
            for (is_decoupled, decayed), tensors in sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1]))]


class DistributedOptimizer:
    def __init__(self, model: nn.Module, buffers: list[GradBuffer], optim: OptimConfig, *,
                 param_dtype: torch.dtype = torch.float32, overlap_param_gather: bool = False,
                 moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
                 master_remainders: bool = False, fp8_layers: dict[nn.Parameter, nn.Module] | None = None,
                 decoupled: Collection[nn.Parameter] = ()):
        """`fp8_layers` (--fp8-param-gather): the FP8 GEMM module of every weight gathered in E4M3;
        a buffer holds either only such weights or none. `decoupled`: the weights that train at
        --decoupled-lr (adamw_groups)."""
        self.buffers = buffers
        self.overlap_param_gather = overlap_param_gather
        device = next(iter(buffers[0].ranges)).device
        remainders = master_remainders and param_dtype == torch.bfloat16
        members: list[tuple[torch.Tensor, nn.Parameter]] = []   # (master slice, the parameter it is of)
        # (master: fp32, or the int16 remainder below the model view; model view, param, offset)
        self._masters: list[tuple[torch.Tensor, torch.Tensor, nn.Parameter, int]] = []
        self._buffer_of: dict[torch.Tensor, GradBuffer] = {}
        self._stored_grads: dict[torch.Tensor, torch.Tensor] = {}
        self.params = []   # per buffer: the model's weights, laid out like its gradients
        for grads in buffers:
            weights = torch.zeros(grads.size, dtype=param_dtype, device=device)
            self.params.append(weights)
            for param, (start, end) in grads.ranges.items():
                flat = param.detach().flatten()
                with torch.no_grad():   # every rank rounds the whole weight as its owner does
                    weights[start:end].copy_(split_master(flat)[0] if remainders else flat)
                for bucket_start, bucket_end in map(grads.shard_range, grads.buckets):
                    lo, hi = max(start, bucket_start), min(end, bucket_end)
                    if lo >= hi:
                        continue
                    # Masters are cut from the fp32 weights before they are cast, so bf16
                    # rounding of the model copy never reaches the optimizer.
                    model_view = weights[lo:hi]
                    if remainders:
                        master = split_master(flat[lo - start:hi - start])[1]
                    elif param_dtype != torch.float32:
                        master = flat[lo - start:hi - start].float().clone()
                    else:
                        master = model_view
                    if grads.stored:
                        self._stored_grads[master] = grads.data[lo:hi]
                    members.append((master, param))
                    self._masters.append((master, model_view, param, lo - start))
                    self._buffer_of[master] = grads
            for param, (start, end) in grads.ranges.items():
                param.data = weights[start:end].view_as(param)  # the model now reads the flat buffer
                if param_dtype != torch.float32:
                    param.grad = None  # main grads: the buffer (filled by its hook) or autograd's bf16 grads
        self.optimizer = MasterAdamW(
            adamw_groups(members, optim.weight_decay, decoupled) or [{"params": [torch.zeros(0, device=device)]}],
            models={master: view for master, view, _, _ in self._masters if master is not view},
            moment_dtypes=moment_dtypes, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
        )
        # With --optimizer-cpu-offload, what steps the optimizer with its state kept in host memory
        # (tessera.training.optim.offload, set by tessera.training.optimizer).
        self.offload = None
        self.fp8: list[Fp8Weights | None] = [self._fp8_weights(grads, fp8_layers or {}) for grads in buffers]
        self._gathers: dict[tuple[int, int], object] = {}   # (buffer, bucket) -> all-gather in flight
        # Every buffer's buckets in the order the forward pass needs them: by their first parameter
        # in the model's order (each buffer lays the earliest layers out last).
        position = {param: i for i, param in enumerate(model.parameters())}
        self._gather_order = sorted(((which, index) for which, grads in enumerate(buffers)
                                     for index in range(len(grads.buckets))),
                                    key=lambda b: min(position[p] for p in buffers[b[0]].buckets[b[1]].params))
        if any(self.fp8):   # the first forward reads the E4M3 weights (the bf16 ones are whole already)
            self._start_gathers(fp8_only=True)
            self.wait_all()
        if overlap_param_gather:
            self._install_wait_hooks(model)

    def _fp8_weights(self, grads: GradBuffer, fp8_layers: dict[nn.Parameter, nn.Module]) -> Fp8Weights | None:
        fp8 = [param in fp8_layers for param in grads.ranges]
        if not any(fp8):
            return None
        if not all(fp8):
            raise ValueError("a gradient buffer mixes FP8 linears' weights with others (--fp8-param-gather)")
        owned = [(view, param, offset) for _, view, param, offset in self._masters if param in grads.ranges]
        return Fp8Weights(grads, fp8_layers, owned)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank: fp32 masters or their remainders (if separate)
        and Adam moments (fp32 or bf16)."""
        moments = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                      for t in s.values() if torch.is_tensor(t) and t.ndim > 0)
        masters = sum(m.numel() * m.element_size() for m, v, _, _ in self._masters if m is not v)
        if not self.optimizer.state:  # before the first step: what the moments will take
            per_element = sum(dtype.itemsize for dtype in self.optimizer.moment_dtypes)
            moments = per_element * sum(m.numel() for m, _, _, _ in self._masters)
        return moments + masters

    def slices(self) -> list[tuple[torch.Tensor, torch.Tensor, nn.Parameter, int]]:
        """(master, model-weight view, parameter, flat offset in it) of every slice this rank
        owns. The master keys the slice's Adam state; it is the view itself when the weights are
        fp32, and the int16 remainder below the view with master remainders."""
        return list(self._masters)

    def master_weights(self) -> list[tuple[torch.Tensor, nn.Parameter, int]] | None:
        """(fp32 master, parameter, flat offset) of every owned slice, or None when the model's
        weights are their own masters. Masters kept as remainders are joined into new tensors in
        host memory (for a checkpoint: no device memory for a second copy): `store_master_weights`
        puts changes to them back."""
        if all(master is view for master, view, _, _ in self._masters):
            return None
        return [(join_master(view.cpu(), master.cpu()) if master.dtype == torch.int16 else master, param, offset)
                for master, view, param, offset in self._masters]

    @torch.no_grad()
    def store_master_weights(self, masters: list[tuple[torch.Tensor, nn.Parameter, int]]) -> None:
        """Set the masters to master_weights()'s tensors, and every rank's model weights from
        their owners' masters, as after a step."""
        for (value, _, _), (master, view, _, _) in zip(masters, self._masters):
            if master.dtype == torch.int16:
                high, low = split_master(value.to(master.device))
                view.copy_(high)
                master.copy_(low)
            else:
                master.copy_(value)
                view.copy_(master)
        self._start_gathers()
        self.wait_all()

    def local_grads_with_offsets(self) -> list[tuple[torch.Tensor, nn.Parameter, int]]:
        """(reduced gradient slice this rank owns, its parameter, the slice's flat offset in it)."""
        return [(self._grad(master, param, offset), param, offset) for master, _, param, offset in self._masters]

    def _grad(self, master: torch.Tensor, param: nn.Parameter, offset: int) -> torch.Tensor:
        if master in self._stored_grads:   # bound at construction
            return self._stored_grads[master]
        return self._buffer_of[master].view(param).view(-1)[offset:offset + master.numel()]

    def step(self) -> None:
        """Step the owned slices (grad_scale/found_inf set by the caller; the model's bf16 copy
        of each slice is written in the same pass), then share them."""
        self.optimizer.grads = {master: grad for (master, *_), (grad, _, _) in
                                zip(self._masters, self.local_grads_with_offsets())}
        (self.optimizer if self.offload is None else self.offload).step()
        self.optimizer.grads = {}   # the next step's zero_grad must be able to free them
        self._start_gathers()
        if not self.overlap_param_gather:
            self.wait_all()

    def _start_gathers(self, fp8_only: bool = False) -> None:
        buffers = [which for which, fp8 in enumerate(self.fp8) if fp8 is not None or not fp8_only]
        for which in buffers:
            if self.fp8[which] is not None:
                self.fp8[which].quantize()
        self._gather([(which, index) for which, index in self._gather_order if which in buffers],
                     [self.params[which] if self.fp8[which] is None else self.fp8[which].data
                      for which in range(len(self.buffers))])

    def _gather(self, buckets: list[tuple[int, int]], sources: list[torch.Tensor]) -> None:
        """Start the all-gathers of these (buffer, bucket)s, each buffer's from its source (the bf16
        weights or their E4M3 copy, laid out alike)."""
        for which, index in buckets:
            grads, weights = self.buffers[which], sources[which]
            if grads.group is None:
                continue
            bucket = grads.buckets[index]
            start, end = grads.shard_range(bucket)
            self._gathers[which, index] = all_gather_flat(
                weights[bucket.start:bucket.end], weights[start:end].clone(), group=grads.group, async_op=True)

    def wait_all(self) -> None:
        for index in list(self._gathers):
            self._gathers.pop(index).wait()

    def gather_model_weights(self) -> None:
        """Every rank's whole bf16 weights: those gathered in E4M3 are current only in the slices
        a rank owns until this all-gathers them (for whatever reads weights other than the FP8 GEMMs)."""
        self.wait_all()
        self._gather([(which, index) for which, index in self._gather_order if self.fp8[which] is not None],
                     self.params)
        self.wait_all()

    def _install_wait_hooks(self, model: nn.Module) -> None:
        """Before each top-level unit (a block, the embedding, ...) runs, wait for its buckets."""
        bucket_index = {p: (which, i) for which, grads in enumerate(self.buffers)
                        for i, b in enumerate(grads.buckets) for p in b.params}
        children = [m for name, m in model.named_children() if name != "layers"] + list(getattr(model, "layers", []))
        for unit in [model, *children]:
            own = unit.parameters(recurse=False) if unit is model else unit.parameters()
            indices = sorted({bucket_index[p] for p in own if p in bucket_index})
            if indices:
                unit.register_forward_pre_hook(lambda _module, _args, indices=indices: self._wait(indices))

    def _wait(self, indices: list[tuple[int, int]]) -> None:
        for index in indices:
            work = self._gathers.pop(index, None)
            if work is not None:
                work.wait()

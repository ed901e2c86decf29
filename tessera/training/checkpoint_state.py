"""What a checkpoint holds, addressed by full (unsharded) tensor coordinates.

torch.distributed.checkpoint (DCP) reshards any saved tensor onto any new layout, if
each rank says which rectangle of the *full* tensor each of its local pieces is. Here
every piece of state is described that way, whatever cut it out of the full tensor:

- tensor parallelism: `ShardSpec` pieces (fused q/k/v blocks, replicated KV groups);
- expert parallelism: a block of experts (dim 0 of stacked expert weights), by global
  expert index, so that a checkpoint saved at one EP size loads at another;
- FSDP2: a DTensor's rows of the TP shard;
- the distributed optimizer: a flat range of the TP shard, cut into at most three
  rectangles (a partial first row, whole rows, a partial last row).

So model weights, Adam moments and fp32 masters are stored once each as full tensors,
and load under any TP / DP / distributed-optimizer / FSDP2 layout. Pieces held by several
ranks (DP replicas, TP-replicated KV groups) are identical; DCP writes one of them. FP8
delayed scaling's amax histories and scales are kept apart from the model's (fp8.*), by
layer name, so that FP8 and bf16 checkpoints hold the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from tessera.kernels.adamw import MasterAdamW
from tessera.kernels.fp8 import Fp8Linear
from tessera.parallel.sharding import ShardSpec
from tessera.parallel.zero import DistributedOptimizer

Block = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the full tensor, a view of local storage)


@dataclass
class Chunked:
    """Some rectangles of one full tensor, each a view of this rank's storage."""

    full_shape: tuple[int, ...]
    blocks: list[Block]

    def size(self) -> torch.Size:  # DCP compares it with the saved tensor's size on load
        return torch.Size(self.full_shape)

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offsets), view.shape),
                              properties=TensorProperties.create_from_tensor(view), size=self.size()))
                for offsets, view in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), view.shape) for offsets, view in self.blocks]

    def block_at(self, offsets) -> torch.Tensor:
        for block_offsets, view in self.blocks:
            if tuple(block_offsets) == tuple(offsets):
                return view
        raise KeyError(f"no block at {tuple(offsets)}")


def whole(tensor: torch.Tensor) -> Chunked:
    """A tensor that each rank holding it holds in full."""
    return Chunked(tuple(tensor.shape), [((0,) * tensor.ndim, tensor)])


def saved_like(metadata) -> Chunked:
    """A new CPU tensor of a saved tensor's shape and dtype (DCP metadata), for DCP to load into."""
    return whole(torch.empty(metadata.size, dtype=metadata.properties.dtype))


class SavePlanner(DefaultSavePlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            return value.block_at(index.offset).contiguous()
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up rebuilds the state dict from the types it knows (tensors,
        # DTensors), which would drop the Chunked entries; nothing here needs flattening.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, Chunked):
            return value.block_at(index.offset)  # a view: DCP copies the data into it in place
        return super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


# -- cutting full-tensor rectangles out of local storage -------------------------------

def _spec(param: nn.Parameter) -> ShardSpec:
    shape = tuple(param.shape)  # for an FSDP2 DTensor: the whole TP shard
    return getattr(param, "shard_spec", None) or ShardSpec(shape)


def _to_full(spec: ShardSpec, view: torch.Tensor, origin: tuple[int, ...]) -> list[Block]:
    """Blocks of the full tensor for `view`, which sits at `origin` in this rank's TP shard."""
    if spec.expert_size > 1:   # this rank's experts start at spec.expert_offset of the full tensor
        origin = (origin[0] + spec.expert_offset, *origin[1:])
    if spec.replicated:
        return [(origin, view)]
    dim, start = spec.dim, origin[spec.dim]
    end = start + view.shape[dim]
    blocks = []
    for piece in spec.pieces():
        lo, hi = max(start, piece.local_start), min(end, piece.local_start + piece.length)
        if lo < hi:
            offsets = list(origin)
            offsets[dim] = piece.full_start + lo - piece.local_start
            blocks.append((tuple(offsets), view.narrow(dim, lo - start, hi - lo)))
    return blocks


def _flat_range_rectangles(flat: torch.Tensor, offset: int, shape: tuple[int, ...]):
    """(view, origin) rectangles covering `flat`, elements [offset, offset + n) of a row-major
    tensor of `shape`: a partial first row, whole rows, a partial last row, each partial row
    cut the same way one dimension down (at most 2 x ndim - 1 rectangles)."""
    if len(shape) == 1:
        return [(flat, (offset,))]
    row_size, end, pieces, position = math.prod(shape[1:]), offset + flat.numel(), [], offset
    while position < end:
        row, within = divmod(position, row_size)
        if within or end - position < row_size:  # part of one row
            length = min(row_size - within, end - position)
            part = flat[position - offset:position - offset + length]
            pieces += [(view.unsqueeze(0), (row, *origin))
                       for view, origin in _flat_range_rectangles(part, within, shape[1:])]
        else:  # as many whole rows as fit
            rows = (end - position) // row_size
            length = rows * row_size
            pieces.append((flat[position - offset:position - offset + length].view(rows, *shape[1:]),
                           (row,) + (0,) * (len(shape) - 1)))
        position += length
    return pieces


def _local_blocks(param: nn.Parameter, tensor: torch.Tensor) -> list[Block]:
    """Blocks of `tensor`, shaped and placed like `param` (a plain shard or an FSDP2 DTensor)."""
    spec = _spec(param)
    if hasattr(tensor, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = tensor.to_local()
        _, origin = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return _to_full(spec, local, tuple(origin)) if local.numel() else []
    return _to_full(spec, tensor, (0,) * tensor.ndim)


def model_state(model: nn.Module, *, frozen: bool = True) -> dict[str, Chunked]:
    """Every parameter (but those that do not train, with `frozen=False`: LoRA's base), and every
    persistent buffer (a MoE router's expert bias; the same on all ranks)."""
    state = {f"model.{_name(name)}": Chunked(_spec(param).full_shape, _local_blocks(param, param.data))
             for name, param in model.named_parameters() if frozen or param.requires_grad}
    for name, buffer in persistent_buffers(model).items():
        state[f"model.{name}"] = whole(buffer)
    return state


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    parameters = {_name(name) for name, _ in model.named_parameters()}
    return {_name(name): tensor for name, tensor in model.state_dict(keep_vars=True).items()
            if _name(name) not in parameters}


def _name(name: str) -> str:
    return name.replace("_orig_mod.", "")  # torch.compile's wrapper does not change what is stored


# -- FP8 delayed scaling --------------------------------------------------------------

_FP8_STATE = ("amax_history", "scales")


def delayed_fp8_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    """The delayed-scaling FP8 GEMMs by module name (global layer indices: the same under any PP layout)."""
    return {_name(name): module for name, module in model.named_modules()
            if isinstance(module, Fp8Linear) and module.recipe.recipe == "delayed"}


def fp8_scaling_state(model: nn.Module) -> dict[str, Chunked]:
    """Amax histories and scales of the delayed-scaling layers that have taken a step. Every rank
    holding a layer holds the same state (amaxes are MAX-reduced over tp_dp_cp), so it is saved
    whole; a layer yet to take a step has nothing to save, and starts fresh on resume as well."""
    return {f"fp8.{name}.{kind}": whole(getattr(layer, kind))
            for name, layer in delayed_fp8_layers(model).items() if layer.calibrated for kind in _FP8_STATE}


def fp8_scaling_targets(model: nn.Module, metadata: dict) -> dict[str, Chunked]:
    """Where to load the saved FP8 scaling state of this model's delayed-scaling layers, those the
    checkpoint has (in its saved shape: --fp8-amax-history-len may have changed)."""
    return {key: saved_like(metadata[key]) for name in delayed_fp8_layers(model) for kind in _FP8_STATE
            if (key := f"fp8.{name}.{kind}") in metadata}


def restore_fp8_scaling(model: nn.Module, state: dict) -> list[str]:
    """Resume each delayed-scaling layer from its loaded state; the names of those the checkpoint lacked."""
    missing = []
    for name, layer in delayed_fp8_layers(model).items():
        keys = [f"fp8.{name}.{kind}" for kind in _FP8_STATE]
        if all(key in state for key in keys):
            layer.resume_scaling(*(state[key].blocks[0][1] for key in keys))
        else:
            missing.append(name)
    return missing


# -- optimizer state -------------------------------------------------------------------

def optimizer_state(model: nn.Module, optimizer, *, create: bool = False) -> dict[str, Chunked]:
    """Adam moments (SGD's momentum) per parameter, and Muon's momentum, as full-tensor blocks.

    `create=True` first makes zero state where the optimizer has none yet (before its first
    step), so that a checkpoint can be loaded into it.
    """
    inner = optimizer.inner
    names = {param: _name(name) for name, param in model.named_parameters()}
    entries: dict[str, list[Block]] = {}
    shapes: dict[str, tuple[int, ...]] = {}

    def add(kind: str, param: nn.Parameter, blocks: list[Block]) -> None:
        key = f"optim.{kind}.{names[param]}"
        entries.setdefault(key, []).extend(blocks)
        shapes[key] = _spec(param).full_shape

    if isinstance(inner, DistributedOptimizer):
        for master, _, param, offset in inner.slices():
            state = _adam_state(inner.optimizer, master, create)
            shape = tuple(param.shape)
            for kind in ("exp_avg", "exp_avg_sq"):
                if kind in state:
                    flat = state[kind]
                    add(kind, param, [b for view, origin in _flat_range_rectangles(flat, offset, shape)
                                      for b in _to_full(_spec(param), view, origin)])
    else:   # a frozen base (LoRA) is in no parameter group: it has no state
        for param in (p for group in inner.param_groups for p in group["params"]):
            state = _adam_state(inner, param, create)
            for kind in _STATE_KINDS:
                if kind in state:
                    add(kind, param, _local_blocks(param, state[kind]))
    muon = getattr(optimizer, "muon", None)
    for param in muon.params if muon is not None else ():   # distributed Muon: the matrices this rank owns
        if create:
            muon.momentum(param)
        if "momentum_buffer" in muon.state[param]:
            add("momentum_buffer", param, _local_blocks(param, muon.state[param]["momentum_buffer"]))
    return {key: Chunked(shapes[key], blocks) for key, blocks in entries.items()}


_STATE_KINDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")   # AdamW's, SGD's


def _adam_state(optimizer: torch.optim.Optimizer, key: torch.Tensor, create: bool) -> dict:
    if create and key not in optimizer.state:
        if isinstance(optimizer, MasterAdamW):   # its moments may be bf16
            return optimizer.state_of(key)
        if isinstance(optimizer, torch.optim.SGD):
            optimizer.state[key] = {"momentum_buffer": torch.zeros_like(key)}
        else:   # what AdamW's first step makes (fused: a float32 step tensor on the parameter's device)
            optimizer.state[key] = {"step": torch.zeros((), dtype=torch.float32, device=key.device),
                                    "exp_avg": torch.zeros_like(key), "exp_avg_sq": torch.zeros_like(key)}
    return optimizer.state.get(key, {})


def optimizer_steps(optimizer) -> float | None:
    """Adam's step count (the same for every parameter), or None before the first step (or with SGD)."""
    inner = optimizer.inner
    adam = inner.optimizer if isinstance(inner, DistributedOptimizer) else inner
    for state in adam.state.values():
        return float(state["step"]) if "step" in state else None
    return None


def set_optimizer_steps(optimizer, steps: float) -> None:
    inner = optimizer.inner
    adam = inner.optimizer if isinstance(inner, DistributedOptimizer) else inner
    for state in adam.state.values():
        state["step"].fill_(steps)


def master_weights(optimizer) -> list[tuple[torch.Tensor, nn.Parameter, int]] | None:
    """A distributed optimizer's fp32 masters kept apart from a bf16 model, as (master,
    parameter, flat offset) slices (DistributedOptimizer.master_weights); None when the model's
    weights are their own masters."""
    inner = optimizer.inner
    return inner.master_weights() if isinstance(inner, DistributedOptimizer) else None


def master_state(model: nn.Module, masters: list[tuple[torch.Tensor, nn.Parameter, int]]) -> dict[str, Chunked]:
    """`master_weights` under the model's keys: saved instead of the bf16 copy, so that the
    stored weights are exact in any layout."""
    names = {param: _name(name) for name, param in model.named_parameters()}
    state: dict[str, Chunked] = {}
    for master, param, offset in masters:
        chunked = state.setdefault(f"model.{names[param]}", Chunked(_spec(param).full_shape, []))
        chunked.blocks += [b for view, origin in _flat_range_rectangles(master, offset, tuple(param.shape))
                           for b in _to_full(_spec(param), view, origin)]
    return state

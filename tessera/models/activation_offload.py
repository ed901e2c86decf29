"""Fine-grained activation offloading (--fine-grained-activation-offloading, --offload-modules).

What chosen parts of each transformer block save for backward goes to host memory as the
forward pass saves it and comes back before their backward needs it, on copy streams of its
own beside the compute stream: Megatron-LM's feature of the same name
(megatron/core/pipeline_parallel/fine_grained_activation_offload.py), with its module names:

    attn_norm    the input norm's                 qkv_linear   the QKV projection's (its input)
    core_attn    attention's own: the rotated     attn_proj    the output projection's (its input)
                 queries and keys, the values,    mlp_norm     the MLP's norm's
                 SDPA's output and log-sum-exp    expert_fc1,  the routed experts' (tessera's grouped
    mlp          the dense MLP's: fc1's input     moe_act      experts run fc1, the activation and
                 and output (tessera's own name)               fc2 in one module: either name takes all)

Each module's call is a group: a forward pre-hook enters torch.autograd.graph.saved_tensors_hooks
and a forward hook leaves it, so every tensor autograd saves inside it is packed by `pack`, which
copies it to (pinned) host memory on the device-to-host stream and keeps only the host copy: the
device memory is free once the forward pass drops its own reference. Parameters (and a weight's
autocast copy, which autocast's cache keeps anyway) and tensors smaller than
--min-offloaded-tensor-size stay where they are. A module nested in a chosen one that is not
chosen itself (the projections inside core_attn's attention) keeps what it saves.

The first time backward unpacks a group's tensor, the whole group is copied back on the
host-to-device stream, and so is the group saved just before it in the forward pass, which
backward needs next: its copy runs while this group's backward computes. Groups are linked only
within one block's call and from one block to the next layer's, so under pipeline parallelism
(1F1B, interleaved) the micro-batches' and model chunks' groups never fetch each other.

Recomputation and offloading divide the work: layers that --recompute-granularity full
recomputes save nothing but their input, so they are left alone; with selective recompute
core_attn has nothing to offload (the recomputation keeps its inputs), which the config refuses.
Compiled blocks save their tensors in one autograd function, with no module boundaries inside,
so the blocks run uncompiled.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.config import ConfigError


def _regions(block: nn.Module, names: set[str]) -> list[tuple[nn.Module, bool]]:
    """(module, offloaded) of one block: the chosen modules, and inside a chosen attention the
    projections and norms that keep their own tensors unless chosen too."""
    attention = getattr(block, "attention", None)
    mlp = getattr(block, "mlp", None)
    experts = getattr(mlp, "experts", None)
    named = {"attn_norm": getattr(block, "input_norm", None), "qkv_linear": getattr(attention, "qkv", None),
             "core_attn": attention, "attn_proj": getattr(attention, "proj", None),
             "mlp_norm": getattr(block, "post_attention_norm", None),
             "mlp": mlp if experts is None else None, "expert_fc1": experts, "moe_act": experts}
    chosen = {named[name] for name in names if named.get(name) is not None}
    regions = [(module, True) for module in chosen]
    if attention in chosen:
        regions += [(child, False) for child in attention.children() if child not in chosen]
    return regions


def install_activation_offload(model: nn.Module, modules: list[str], device: torch.device, min_size: int,
                               skip_layers: set[int] = frozenset()) -> "ActivationOffload":
    """Offload what `modules` save in every block of `model.layers` but those in `skip_layers`
    (recomputed whole). Raises ConfigError when no block has any of them."""
    offload = ActivationOffload(device, min_size)
    found = False
    for index, block in model.layers.items():
        if index in skip_layers:
            continue
        regions = _regions(block, set(modules))
        found = found or any(offloaded for _, offloaded in regions)
        block.register_forward_pre_hook(lambda _module, _args, index=index: offload.start_block(index))
        for module, offloaded in regions:
            module.register_forward_pre_hook(lambda _module, _args, offloaded=offloaded: offload.enter(offloaded))
            module.register_forward_hook(lambda _module, _args, _output: offload.leave(), always_call=True)
    if not found:
        raise ConfigError(f"--offload-modules {' '.join(modules)}: no layer of this model has these modules "
                          "(or every layer is recomputed)")
    return offload


@dataclass(eq=False)
class _Group:
    """The storages one module call saved, and the group saved before it (backward's next)."""

    block: tuple[int, int]                        # (layer index, block call) it was saved in
    members: list = field(default_factory=list)   # weak references to its _Stored
    open: dict = field(default_factory=dict)      # while the module runs: device storage pointer -> (storage, _Stored)
    previous: weakref.ref | None = None
    reloaded: bool = False


class _Stored:
    """The bytes of one device storage: their host copy, then their device copy once brought back."""

    __slots__ = ("host", "group", "stored", "device_copy", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, group: _Group, stored):
        self.host, self.group, self.stored = host, group, stored
        self.device_copy, self.ready = None, None


class _Saved:
    """A saved tensor as a view of its storage's copy: the same dtype, size, strides and offset,
    so that backward's kernels see the layout they would have seen (a strided view of the fused
    gate-and-up output stays one)."""

    __slots__ = ("data", "dtype", "size", "stride", "offset")

    def __init__(self, data: _Stored, tensor: torch.Tensor):
        self.data, self.dtype, self.size = data, tensor.dtype, tensor.size()
        self.stride, self.offset = tensor.stride(), tensor.storage_offset()


class ActivationOffload:
    """The packing hooks, the copy streams and the groups of one rank's model."""

    def __init__(self, device: torch.device, min_size: int):
        self.device, self.min_size = device, min_size
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.down, self.up = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self._contexts: list = []              # (saved-tensor hooks entered, their group), innermost last
        self._block, self._calls = (-1, 0), 0
        self._last: weakref.ref | None = None  # the group that last saved a tensor

    def start_block(self, index: int) -> None:
        self._calls += 1
        self._block = (index, self._calls)

    def enter(self, offloaded: bool) -> None:
        group = None
        if not torch.is_grad_enabled():   # nothing is saved (evaluation)
            context = nullcontext()
        elif offloaded:
            group = _Group(self._block)
            context = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack)
        else:
            context = torch.autograd.graph.saved_tensors_hooks(_same, _same)
        context.__enter__()
        self._contexts.append((context, group))

    def leave(self) -> None:
        context, group = self._contexts.pop()
        context.__exit__(None, None, None)
        if group is not None:   # the device storages may go now (the forward pass holds what it still needs)
            group.open.clear()

    def _kept(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor stays on the device: a parameter, a view of one or its autocast
        copy; a small one; one elsewhere."""
        if tensor.numel() < self.min_size or tensor.device != self.device:
            return True
        base = tensor if tensor._base is None else tensor._base
        cast = base.grad_fn
        return base.is_leaf or (cast.name() == "ToCopyBackward0" and
                                type(cast.next_functions[0][0]).__name__ == "AccumulateGrad")

    def _pack(self, tensor: torch.Tensor, group: _Group):
        if self._kept(tensor):
            return tensor
        storage = tensor.untyped_storage()
        # One copy per storage in a group; the group holds the storage while the module runs, so that
        # its address cannot be reused by another tensor saved in the same call.
        _, data = group.open.get(storage.data_ptr(), (None, None))
        if data is None:
            if not group.members:   # the group's first: link it to the group saved before, if backward's next
                self._link(group)
            data = _Stored(self._copy_down(storage), group, self.down.record_event() if self.cuda else None)
            group.open[storage.data_ptr()] = (storage, data)
            group.members.append(weakref.ref(data))
        return _Saved(data, tensor)

    def _copy_down(self, storage) -> torch.Tensor:
        """A host copy of a device storage's bytes, made on the device-to-host stream."""
        device_bytes = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.cuda)
        if not self.cuda:
            host.copy_(device_bytes)
            return host
        self.down.wait_stream(torch.cuda.current_stream())   # after the kernel that wrote it
        with torch.cuda.stream(self.down):
            host.copy_(device_bytes, non_blocking=True)
        device_bytes.record_stream(self.down)   # its memory is not reused before the copy is done
        return host

    def _link(self, group: _Group) -> None:
        """The group saved just before, if it is in this block's call or the previous layer's, just before."""
        last = self._last() if self._last is not None else None
        (layer, call), self._last = group.block, weakref.ref(group)
        if last is not None and (last.block[1] == call or last.block == (layer - 1, call - 1)):
            group.previous = weakref.ref(last)

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        data = saved.data
        self._reload(data.group)
        previous = data.group.previous() if data.group.previous is not None else None
        if previous is not None:
            self._reload(previous)   # backward's next group, copied while this one computes
        if data.ready is not None:
            torch.cuda.current_stream().wait_event(data.ready)
            data.device_copy.record_stream(torch.cuda.current_stream())
            data.ready = None
        return torch.empty(0, dtype=saved.dtype, device=self.device).set_(
            data.device_copy.untyped_storage(), saved.offset, saved.size, saved.stride)

    def _reload(self, group: _Group) -> None:
        """Start copying the group's storages back to the device (once)."""
        if group.reloaded:
            return
        group.reloaded = True
        for member in group.members:
            data = member()
            if data is None:
                continue
            if self.cuda:   # made on the copy stream: its memory is free there (_unpack records the compute stream)
                self.up.wait_event(data.stored)
                with torch.cuda.stream(self.up):
                    copy = torch.empty_like(data.host, device=self.device)
                    copy.copy_(data.host, non_blocking=True)
                data.ready = self.up.record_event()
            else:
                copy = torch.empty_like(data.host, device=self.device)
                copy.copy_(data.host)
            data.device_copy, data.host = copy, None


def _same(tensor):
    return tensor

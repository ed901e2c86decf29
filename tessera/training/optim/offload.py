"""Optimizer state in host memory (--optimizer-cpu-offload, --optimizer-offload-fraction).

The distributed optimizer's fp32 masters (or their remainders, or none where the model's fp32
weights are their own) and Adam's two moments live in pinned host memory between steps; the
device keeps the model's weights and gradients. --optimizer-offload-fraction f offloads the first
f of the state, by elements, in the order of the gradient buffers, as Megatron-LM's
HybridDeviceOptimizer does (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py); the
rest stays on the device.

The step streams the offloaded state through the device, a chunk of slices at a time: one copy
stream brings chunk i + 1 up while the compute stream steps chunk i with the distributed
optimizer's own AdamW kernel and a second copy stream takes chunk i - 1 back down, so both
directions of the host link are busy at once and at most IN_FLIGHT chunks are on the device.
Megatron-LM steps its offloaded state on the host with torch's CPU Adam instead. Streaming is
chosen here for two reasons:

- exactness: the device runs the same kernel as without offload, so offload moves the state and
  never changes a bit of the weights, on GPUs as on the CPU (tests/training/test_offload.py);
  a CPU Adam rounds differently from the GPU kernel;
- speed: the step is bound by the host link: 12 bytes a parameter up and 12 down at once (fp32
  master and moments) over PCIe 5 x16, about 50 GB/s each way, some 0.25 s per billion
  parameters. A CPU step moves the bf16 gradients down and the weights up, 4 bytes a parameter
  (0.08 s), and then runs torch's fused CPU AdamW, 3.4e8 parameters/s on one core (a Xeon,
  torch 2.13): 0.18 s per billion on the 16 cores of an H200 machine's share if it scaled
  perfectly, which it does not, 30 bytes a parameter of host memory traffic at that rate being
  160 GB/s, more than those cores get. So the CPU step is at best as fast and is slower as soon
  as host memory, or the data loader beside it, is the limit.

What overlaps the backward pass: the step needs every gradient and their global norm (the
clip), so it starts after the backward; `prefetch` brings the first chunks up while the last
micro-batch runs (from its backward, under pipeline parallelism), so the step starts on state
already there. The step ends by
waiting for its last copy down, so that whatever reads the state next (a checkpoint) reads it
whole.

Between steps each offloaded tensor keeps its identity: its `.data` is swapped to a device copy
for its chunk's step and back to the host copy after, so the optimizer's state dict and the
checkpoint code (tessera.training.checkpoint_state) address the same tensors with or without
offload, and a checkpoint is the same either way.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import torch

from tessera.kernels.adamw import MasterAdamW

# Elements of state per chunk (12 bytes each with fp32 masters and moments: 384 MiB) and chunks
# on the device at once (one going up, one stepping, one going down).
CHUNK_ELEMENTS = 2**25
IN_FLIGHT = 3
MOMENTS = ("exp_avg", "exp_avg_sq")


def offload_state(optimizer, fraction: float) -> "OptimizerOffload":
    """The offload of a tessera.parallel.zero.DistributedOptimizer's state (its `offload`)."""
    slices = optimizer.slices()
    return OptimizerOffload(optimizer.optimizer, [master for master, _, _, _ in slices],
                            {master for master, view, _, _ in slices if master is not view}, fraction,
                            optimizer.params[0].device)


class OptimizerOffload:
    """Keeps the state of the first `fraction` of `masters` (the optimizer's keys, in buffer
    order) in host memory and steps it streamed through `device`. `apart`: the masters kept
    apart from the model's weights (moved to the host too); the others are the weights."""

    def __init__(self, optimizer: MasterAdamW, masters: list[torch.Tensor], apart: set[torch.Tensor],
                 fraction: float, device: torch.device):
        self.optimizer, self.device = optimizer, device
        self.pin = device.type == "cuda"
        threshold, counted, offloaded = fraction * sum(m.numel() for m in masters), 0, []
        for master in masters:
            if counted >= threshold:
                break
            offloaded.append(master)
            counted += master.numel()
        self.apart = {m for m in offloaded if m in apart}
        self.offloaded = set(offloaded)
        self.chunks = _chunks(offloaded, CHUNK_ELEMENTS)
        with torch.no_grad():
            for master in self.apart:
                master.data = self._host(master.data)
        self.copies = _CopyStreams(device)
        self._early: dict[int, list] = {}   # chunk index -> its (tensor, host copy) pairs, brought up already

    def host_bytes(self) -> int:
        """Bytes of state kept in host memory: the masters apart and the offloaded masters' moments
        (before the first step, what they will take)."""
        moments = sum(dtype.itemsize for dtype in self.optimizer.moment_dtypes)
        return sum(m.numel() * m.element_size() for m in self.apart) + moments * sum(m.numel() for m in self.offloaded)

    def prefetch(self) -> None:
        """Start bringing the first chunks up (at the last backward): the step finds them there."""
        for index in range(min(IN_FLIGHT - 1, len(self.chunks))):
            if index not in self._early:
                self._early[index] = self._upload(self.chunks[index])

    @torch.no_grad()
    def step(self) -> None:
        """MasterAdamW.step over `optimizer.grads`: the slices on the device at once, then the
        offloaded ones chunk by chunk."""
        optimizer, grads = self.optimizer, self.optimizer.grads
        self._step_on({key: grad for key, grad in grads.items() if key not in self.offloaded})
        downs: deque = deque()
        up = self._brought_up(0) if self.chunks else None
        for index, chunk in enumerate(self.chunks):
            if len(downs) == IN_FLIGHT - 1:   # bound the device copies: wait for an older chunk's way down
                downs.popleft().synchronize()
            following = self._brought_up(index + 1) if index + 1 < len(self.chunks) else None
            self.copies.compute_waits_for_upload()
            self._step_on({key: grads[key] for key in chunk if key in grads})
            downs.append(self._download(chunk, up))
            up = following
        for event in downs:
            event.synchronize()
        optimizer.grads = grads

    def _brought_up(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Chunk `index` on its way up: prefetched, or now (an empty list is a chunk with nothing to bring)."""
        early = self._early.pop(index, None)
        return early if early is not None else self._upload(self.chunks[index])

    def _step_on(self, grads: dict[torch.Tensor, torch.Tensor]) -> None:
        """Step these masters only (never none: MasterAdamW's CPU path then copies every master)."""
        if grads:
            self.optimizer.grads = grads
            self.optimizer.step()

    def _tensors(self, chunk: list[torch.Tensor]) -> list[torch.Tensor]:
        """The chunk's offloaded tensors: masters apart from the weights, and moments made so far."""
        tensors = []
        for master in chunk:
            if master in self.apart:
                tensors.append(master)
            state = self.optimizer.state.get(master, {})
            tensors += [state[kind] for kind in MOMENTS if kind in state]
            if "step" in state and state["step"].device != self.device:   # made on the host (a checkpoint load)
                state["step"] = state["step"].to(self.device)
        return tensors

    def _upload(self, chunk: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copy the chunk's state up on the upload stream; its tensors now address the device copies.
        Returns (tensor, its host copy) pairs."""
        pairs = []
        with self.copies.upload_context():
            for tensor in self._tensors(chunk):
                host = self._host(tensor.data)
                copy = torch.empty_like(host, device=self.device)
                copy.copy_(host, non_blocking=True)
                tensor.data = copy
                pairs.append((tensor, host))
        self.copies.uploaded()
        return pairs

    def _download(self, chunk: list[torch.Tensor], up: list[tuple[torch.Tensor, torch.Tensor]]):
        """After the chunk's step, copy its state down on the download stream and point its tensors
        at the host copies again (new ones for moments the step made). Returns an event to wait on."""
        hosts = {tensor: host for tensor, host in up}
        self.copies.download_waits_for_compute()
        with self.copies.download_context():
            for tensor in self._tensors(chunk):
                host = hosts.get(tensor)
                if host is None:
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
                copy = tensor.data
                host.copy_(copy, non_blocking=True)
                self.copies.keep_until_downloaded(copy)
                tensor.data = host
        return self.copies.downloaded()

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in host memory, pinned when the device is a GPU (a copy unless it is so already)."""
        if tensor.device.type == "cpu" and (tensor.is_pinned() or not self.pin):
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
        host.copy_(tensor)
        return host


def _chunks(masters: list[torch.Tensor], elements: int) -> list[list[torch.Tensor]]:
    """Consecutive masters in groups of at least `elements` (the last may hold fewer)."""
    chunks, current, size = [], [], 0
    for master in masters:
        current.append(master)
        size += master.numel()
        if size >= elements:
            chunks.append(current)
            current, size = [], 0
    return chunks + ([current] if current else [])


class _CopyStreams:
    """The two copy streams beside the compute stream, on a GPU; on the CPU every copy is done
    when it returns, and the events are ones that are already complete."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.up, self.down = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self._uploads: deque = deque()

    def upload_context(self):
        # The host copies are whole (the last step waited for them) and the device ones new: nothing to wait for.
        return torch.cuda.stream(self.up) if self.cuda else nullcontext()

    def uploaded(self) -> None:
        if self.cuda:
            self._uploads.append(self.up.record_event())

    def compute_waits_for_upload(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self._uploads.popleft())

    def download_waits_for_compute(self) -> None:
        if self.cuda:
            self.compute = torch.cuda.current_stream()
            self.down.wait_stream(self.compute)

    def download_context(self):
        return torch.cuda.stream(self.down) if self.cuda else nullcontext()

    def keep_until_downloaded(self, copy: torch.Tensor) -> None:
        """The device copy was made on the upload stream and read by the other two: the allocator
        must not hand its memory out again before they are done with it."""
        if self.cuda:
            copy.record_stream(self.compute)
            copy.record_stream(self.down)

    def downloaded(self):
        return self.down.record_event() if self.cuda else _Done()


class _Done:
    def synchronize(self) -> None:
        pass

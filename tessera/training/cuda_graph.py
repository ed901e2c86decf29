"""--cuda-graph-impl full_iteration: a training step's forward and backward passes replayed as one CUDA graph.

Eagerly the host launches each of a step's kernels, about 1,200 on config M, many of them a
few microseconds long (the MoE layers' routing and permutation); where the host falls
behind, the GPU idles between kernels (6.7% of M's step on an H200, docs/performance.md).
Captured once, every micro-batch's forward and backward is one launch. The optimizer step
stays eager (Megatron's full_iteration scope: forward and backward, not the optimizer): the
host queues it, and the next step's copies and replay, while the GPU runs the graph.

After --cuda-graph-warmup-steps eager steps (blocks compiled, kernels tuned), the step's
micro-batches are copied into buffers of the graph's own, one eager pass runs on a side
stream (so that per-stream state such as cuBLAS workspaces exists before the capture), its
statistics are dropped, then the step is captured and replayed. Every later step copies its
micro-batches and its loss weight (loss scale / the batch's tokens) into those buffers and
replays. The activations live in the graph's private memory pool, allocated at the capture: a
replay allocates nothing (torch.cuda.max_memory_allocated counts them only from the capture). What the graph writes stays at the addresses of the capture: the gradients
(autograd's, or the main-grad buffers), the loss sums, the routers' token counts; the eager
code between steps reads them there, and nothing may swap them for new tensors.

The same kernels run in the same order as eagerly, so a replayed step computes exactly what
an eager one does (tests/gpu/test_cuda_graph_cuda.py). What cannot be captured is refused
when the run is configured (RunConfig: several ranks, dropout, recomputation, delayed FP8
scaling, FSDP2, packed documents, MoE experts in a loop or dropping tokens unpadded); anything
else that makes the host wait for the GPU fails the capture with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Batch = dict[str, torch.Tensor]
FLAG = "--cuda-graph-impl full_iteration"


class StepGraph:
    """Runs `forward_backward(micro_batches, loss_weight)` eagerly for the warm-up steps, then
    captures it once and replays it on each step's micro-batches."""

    def __init__(self, forward_backward: Callable[[list[Batch], torch.Tensor], None], *, warmup_steps: int,
                 drop_statistics: Callable[[], None]):
        self.forward_backward = forward_backward
        self.warmup_steps = warmup_steps
        self.drop_statistics = drop_statistics   # what the side stream's pass counted (router loads)
        self.eager_steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.batches: list[Batch] = []
        self.loss_weight: torch.Tensor | None = None

    def run(self, micro_batches: list[Batch], loss_weight: torch.Tensor) -> None:
        if self.graph is None and self.eager_steps < self.warmup_steps:
            self.eager_steps += 1
            self.forward_backward(micro_batches, loss_weight)
            return
        if self.graph is None:
            self._capture(micro_batches, loss_weight)
        self._copy_in(micro_batches, loss_weight)
        self.graph.replay()

    def _capture(self, micro_batches: list[Batch], loss_weight: torch.Tensor) -> None:
        self.batches = [{key: value.clone() for key, value in batch.items()} for batch in micro_batches]
        self.loss_weight = loss_weight.detach().clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward_backward(self.batches, self.loss_weight)
        torch.cuda.current_stream().wait_stream(side)
        self.drop_statistics()
        # The eager passes' activations sit in the allocator's cache, where the graph's private
        # pool cannot reuse them: give them back first, or the activations are held twice.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.forward_backward(self.batches, self.loss_weight)
        except RuntimeError as error:
            raise RuntimeError(f"{FLAG}: the training step could not be captured (something in it waits for "
                               f"the GPU or changes shape between steps): {error}") from error
        self.graph = graph

    def _copy_in(self, micro_batches: list[Batch], loss_weight: torch.Tensor) -> None:
        if len(micro_batches) != len(self.batches):
            raise RuntimeError(f"{FLAG}: {len(micro_batches)} micro-batches, the graph has {len(self.batches)}")
        for static, batch in zip(self.batches, micro_batches):
            if batch.keys() != static.keys():
                raise RuntimeError(f"{FLAG}: a micro-batch holds {sorted(batch)}, the graph's {sorted(static)}")
            for key, buffer in static.items():
                if batch[key].shape != buffer.shape:
                    raise RuntimeError(f"{FLAG}: the micro-batch's {key} is {tuple(batch[key].shape)}, the "
                                       f"graph's {tuple(buffer.shape)}: every step must have the same shapes")
                buffer.copy_(batch[key])
        self.loss_weight.copy_(loss_weight)

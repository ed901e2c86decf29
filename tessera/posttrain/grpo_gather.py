"""The whole model on every rank of a pipeline group, for GRPO's rollouts under pipeline parallelism.

The inference engine runs whole models, and a pipeline stage holds some of the layers (the
embedding on the first stage, the final norm and output layer on the last). Before each rollout
every rank of a pipeline group assembles the whole model: a GPTModel built from the same config
without stages, whose parameters and buffers are this stage's own tensors where it holds them (the
same tensors, nothing copied) and tensors received from their stage elsewhere (one broadcast over
the pipeline group per tensor, from the first stage holding it). A stage names its layers by their
global index (tessera.models.gpt.LayerStack), so its names are the whole model's. Tensor
parallelism stays as it is: the ranks of a pipeline group share a tensor-parallel rank, and each
holds and receives that rank's shards. LoRA's adapters come with their layers, unmerged, as the
engine reads them without pipeline parallelism.

Every rank of the group then runs the same engine on the same requests and seeds, so all sample
the same answers and build the same micro-batches (tessera.posttrain.grpo_rollout).

Memory: one whole model per rank (its tensor-parallel share) while it exists. Kept with the engine
(--rl-kv-cache-management-mode persist) it is filled again in place before each rollout, so that
the engine's CUDA graphs keep reading its tensors; with recompute it goes with the engine after
each rollout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera.config import RunConfig
from tessera.models.gpt import GPTModel
from tessera.parallel.mesh import Mesh


def _tensors(model: nn.Module) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """(its module, its attribute, its name, itself) of every parameter and buffer, in a fixed order."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], name, tensor)
            for name, tensor in named]


class WholeModel:
    """Called, the whole model with the stages' current weights, on every rank of `stage`'s pipeline
    group at once (a collective over it). `keep`: the same model each call, filled again in place."""

    def __init__(self, stage: GPTModel, config: RunConfig, mesh: Mesh, device: torch.device, *, keep: bool):
        self.stage, self.config, self.mesh, self.device, self.keep = stage, config, mesh, device, keep
        self.group = mesh.group("pp")
        mine = {name: (tuple(tensor.shape), tensor.dtype) for *_, name, tensor in _tensors(stage)}
        stages: list[dict] = [None] * mesh.pp_size
        dist.all_gather_object(stages, mine, group=self.group)
        self.shapes = {name: held for holding in reversed(stages) for name, held in holding.items()}
        self.holders = {name: [s for s, holding in enumerate(stages) if name in holding] for name in self.shapes}
        self._model: GPTModel | None = None

    def __call__(self) -> GPTModel:
        model = self._model or self._assemble()
        self._receive(model)
        if self.keep:
            self._model = model
        return model

    def _assemble(self) -> GPTModel:
        """The whole model's modules, holding this stage's tensors and room for the others'."""
        with torch.device("meta"):   # no expert groups: --grpo refuses expert parallelism
            model = GPTModel(self.config.model, tp_group=self.mesh.tp_group)
        self._adopt(model)
        if self.config.posttrain.lora:
            from tessera.posttrain.lora import apply_lora

            apply_lora(model, self.config.posttrain, self.config.train.seed)   # the other stages' adapters
            self._adopt(model)                                                  # this stage's are its own
        return model.eval()

    def _adopt(self, model: GPTModel) -> None:
        """This stage's tensors in their places; empty ones of the holder's shape and dtype elsewhere."""
        own = {name: tensor for *_, name, tensor in _tensors(self.stage)}
        for module, key, name, tensor in _tensors(model):
            if name in own:
                setattr(module, key, own[name])
            elif tensor.is_meta:
                if name not in self.shapes:
                    raise RuntimeError(f"no pipeline stage holds {name} of the whole model")
                shape, dtype = self.shapes[name]
                empty = torch.empty(shape, dtype=dtype, device=self.device)
                if isinstance(tensor, nn.Parameter):
                    empty = nn.Parameter(empty, requires_grad=False)
                    empty.__dict__.update(tensor.__dict__)   # its shard_spec, for LoRA's adapters
                setattr(module, key, empty)

    @torch.no_grad()
    def _receive(self, model: GPTModel) -> None:
        """Every tensor some stage lacks, broadcast from the first stage holding it. A later holder
        (the last stage's copy of a tied embedding) receives into its own copy, which the pipeline
        keeps equal to the first stage's (tessera.parallel.pipeline): nothing changes there."""
        works = []
        for *_, name, tensor in _tensors(model):
            holders = self.holders[name]
            if len(holders) < self.mesh.pp_size:
                source = dist.get_global_rank(self.group, holders[0])
                works.append(dist.broadcast(tensor.detach(), src=source, group=self.group, async_op=True))
        for work in works:
            work.wait()

"""Train the same tiny model single-process and under parallel layouts, and compare.

Every layout must reproduce the single-process run: the loss and the gradient norm at
every step (and the MoE and MTP losses), and every parameter after the last step.

Tolerance, fp32 on CPU: the layouts add the same numbers in another order (all-reduce of
partial gradient sums, reduce-scatter, sharded norms), which changes results by a few
ulps per operation. Losses and gradient norms are compared element-wise at rtol 1e-5.
Parameters are compared per tensor by ||a - b|| / ||b|| <= 1e-5: Adam divides each
update by sqrt(v), which magnifies rounding in individual near-zero gradients, so an
element-wise relative bound would test that amplification, not the layout.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist

from tessera.cli.args import parse_run_config
from tessera.parallel.collectives import all_gather_flat
from tessera.training.checkpoint_state import persistent_buffers
from tessera.training.trainer import Trainer

STEPS = 5
BASE = ["--model", "tiny-llama", "--mock-data", "--lr", "3e-3", "--train-iters", str(STEPS),
        "--micro-batch-size", "2", "--global-batch-size", "16", "--log-interval", "1000", "--num-workers", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "11", "--lr-warmup-iters", "1"]


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter (and persistent buffer) as the full tensor, whatever the layout:
    DTensor (FSDP2) shards are gathered over DP, tensor-parallel shards over TP (expert
    weights over expert-TP) and reassembled by their ShardSpec, expert blocks over EP,
    pipeline stages' parameters over PP."""
    full = {}
    mesh = trainer.mesh
    for name, param in trainer.model.named_parameters():
        tensor = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().float()
        spec = param.shard_spec
        group = mesh.group("etp") if param.is_expert else mesh.tp_group
        if group is not None and not spec.replicated:
            tensor = spec.unshard(_gather(tensor, group))
        if spec.expert_size > 1:
            tensor = torch.cat(_gather(tensor, mesh.group("ep")))
        full[name] = tensor.clone()
    full.update({name: buffer.detach().float().clone() for name, buffer in persistent_buffers(trainer.model).items()})
    return _merge_pipeline_stages(full, mesh.group("pp"))


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _merge_pipeline_stages(stage: dict[str, torch.Tensor], pp_group) -> dict[str, torch.Tensor]:
    """All stages' parameters in one dict (global layer names are unique); a weight held by
    two stages (the tied word embedding) must be the same on both."""
    if pp_group is None:
        return stage
    stages = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, stage, group=pp_group)
    merged = {}
    for params in stages:
        for name, tensor in params.items():
            if name in merged:
                torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0,
                                           msg=lambda m, name=name: f"stage copies of {name} differ\n{m}")
            merged[name] = tensor
    return merged


def train(flags: list[str]) -> dict:
    world = dist.get_world_size() if dist.is_initialized() else 1
    config, _ = parse_run_config(BASE + flags, "test", world_size=world)
    trainer = Trainer(config)
    return result(trainer, trainer.train())


def result(trainer: Trainer, history: list) -> dict:
    """What assert_equivalent compares, of a finished run (on every rank: parameters are gathered)."""
    return {"loss": [r.loss for r in history], "grad_norm": [r.grad_norm for r in history],
            "moe": [r.moe for r in history], "terms": [r.terms for r in history], "params": full_parameters(trainer)}


def train_layouts(layouts: dict[str, list[str]]) -> dict[str, dict]:
    """Run on every rank: each layout in turn; results of rank 0."""
    return {name: train(flags) for name, flags in layouts.items()}


def assert_equivalent(reference: dict, result: dict, layout: str, *, params_rtol: float = 1e-5,
                      terms_atol: float = 0) -> None:
    # equal_nan: an overflowing fp16 step has a non-finite norm on every layout alike.
    torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=0, equal_nan=True,
                               msg=lambda m: f"{layout}: loss differs\n{m}")
    torch.testing.assert_close(result["grad_norm"], reference["grad_norm"], rtol=1e-5, atol=0, equal_nan=True,
                               msg=lambda m: f"{layout}: grad norm differs\n{m}")
    torch.testing.assert_close(result["moe"], reference["moe"], rtol=1e-5, atol=0,
                               msg=lambda m: f"{layout}: MoE losses or load differ\n{m}")
    torch.testing.assert_close(result.get("terms"), reference.get("terms"), rtol=1e-5, atol=terms_atol,
                               msg=lambda m: f"{layout}: MTP losses (or DPO's terms) differ\n{m}")
    assert result["params"].keys() == reference["params"].keys(), layout
    for name, expected in reference["params"].items():
        actual = result["params"][name]
        error = ((actual - expected).norm() / expected.norm()).item()
        assert error <= params_rtol, f"{layout}: parameter {name} differs by {error:.2e} (relative norm)"


class _LateGather:
    """An asynchronous all-gather whose result reaches the output only at wait()."""

    def __init__(self, output: torch.Tensor, received: torch.Tensor):
        self.output, self.received = output, received

    def wait(self) -> bool:
        self.output.copy_(self.received)
        return True


@contextlib.contextmanager
def late_parameter_gathers():
    """Asynchronous all-gathers deliver at wait(), never before: whatever reads weights that
    --overlap-param-gather is still gathering then reads stale ones on every run, not only
    when the race goes the wrong way."""
    def late(output, input, *, group, async_op=False):
        received = torch.empty_like(output) if async_op else output
        all_gather_flat(received, input, group=group)
        return _LateGather(output, received) if async_op else None

    with mock.patch("tessera.parallel.zero.all_gather_flat", late):
        yield

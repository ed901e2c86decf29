"""Token dispatch under expert parallelism against one process (gloo, 4 processes).

Every rank builds the same MoE layer twice from one seed: whole (one process's layer) and
cut over the expert-parallel / expert-tensor-parallel ranks of the layout. Each rank routes
its own tokens. A dropless MoE treats tokens independently, so each rank's output must be
the whole layer's output on its tokens, its input gradient the whole layer's, and the
weights' gradients, summed over the ranks holding the same weights (all of them for the
router, the expert-data-parallel group for experts), the whole layer's gradient of the sum
of every rank's loss. Layouts differ only in the order of additions: per-tensor relative error
1e-6, as for the TP layers (tests/dist/test_tensor_parallel.py).
"""

import pytest
import torch
import torch.distributed as dist

from tessera.config import ModelConfig, ParallelConfig
from tessera.models.gpt import initialize_parameters
from tessera.models.moe import MoELayer
from tessera.parallel.experts import ExpertGroups
from tessera.parallel.mesh import Mesh
from tests.dist.launcher import run_distributed

TOLERANCE = 1e-6
BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=8, vocab_size=32, disable_bias_linear=True,
            num_experts=4, moe_ffn_hidden_size=12, ffn_hidden_size=32, swiglu=True, moe_aux_loss_coeff=[0.1])


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _layer_errors(parallel: dict, fields: dict) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = Mesh.build(ParallelConfig(**parallel), "cpu")
    config = ModelConfig(**{**BASE, **fields})
    whole = MoELayer(config, 0.02)
    cut = MoELayer(config, 0.02, groups=ExpertGroups.from_mesh(mesh, parallel.get("moe_token_dispatcher_type",
                                                                                    "allgather")))
    for layer in (whole, cut):
        initialize_parameters(layer, seed=3)
        layer.aux_loss_scale.fill_(0.5)
    xs = [_randn(2, 8, 16, seed=r).requires_grad_() for r in range(world)]
    gs = [_randn(2, 8, 16, seed=100 + r) for r in range(world)]
    expected = [whole(x) for x in xs]
    sum((y * g).sum() for y, g in zip(expected, gs)).backward()
    mine = xs[rank].detach().clone().requires_grad_()
    out = cut(mine)
    (out * gs[rank]).sum().backward()
    errors = {"output": _error(out, expected[rank]), "input grad": _error(mine.grad, xs[rank].grad)}
    for name, param in cut.named_parameters():
        grad = param.grad.clone()
        if not param.is_expert:   # replicated: each rank holds the gradient of its own tokens
            dist.all_reduce(grad)
            full = dict(whole.named_parameters())[name].grad
        else:   # this rank's experts' slices, summed over the ranks holding the same ones
            if mesh.group("edp") is not None:
                dist.all_reduce(grad, group=mesh.group("edp"))
            full = param.shard_spec.shard(dict(whole.named_parameters())[name].grad)
        errors[f"grad {name}"] = _error(grad, full)
    return errors


LAYOUTS = {
    "EP=4 allgather": ({"expert_model_parallel_size": 4}, {}),
    "EP=4 alltoall": ({"expert_model_parallel_size": 4, "moe_token_dispatcher_type": "alltoall"}, {}),
    "EP=2 x ETP=2 allgather": ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2}, {}),
    "EP=2 x ETP=2 alltoall": ({"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2,
                               "moe_token_dispatcher_type": "alltoall"}, {}),
    "ETP=4, GeLU experts": ({"expert_tensor_parallel_size": 4}, {"swiglu": False}),
    "ETP=4 alltoall (nothing to send)": ({"expert_tensor_parallel_size": 4, "moe_token_dispatcher_type": "alltoall"},
                                         {}),
    "EP=2 alltoall, shared expert, sigmoid top-3": (
        {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"},
        {"moe_shared_expert_intermediate_size": 8, "moe_shared_expert_gate": True,
         "moe_router_score_function": "sigmoid", "moe_router_topk": 3}),
    # Capacity drops differ per rank: pairs of different counts travel.
    "EP=2 allgather, capacity": ({"expert_model_parallel_size": 2}, {"moe_expert_capacity_factor": 0.5}),
    "EP=2 alltoall, capacity": ({"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "alltoall"},
                                {"moe_expert_capacity_factor": 0.5}),
    "EP=4 alltoall, padded to capacity": ({"expert_model_parallel_size": 4, "moe_token_dispatcher_type": "alltoall"},
                                          {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}),
}


def _all_layouts() -> dict[str, dict[str, float]]:
    return {name: _layer_errors(*LAYOUTS[name]) for name in LAYOUTS}


@pytest.fixture(scope="module")
def errors():
    return run_distributed(_all_layouts, 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dispatch_matches_one_process(errors, layout):
    for rank, by_layout in enumerate(errors):
        for quantity, error in by_layout[layout].items():
            assert error <= TOLERANCE, f"{layout}, rank {rank}: {quantity} differs by {error:.2e}"

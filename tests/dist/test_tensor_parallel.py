"""Tensor and sequence parallelism against single-process computation (gloo, 4 processes).

Every rank builds the full weights from a seed, computes the single-process reference
with plain torch (nn.Linear, nn.Embedding, F.cross_entropy, GPTModel at TP=1), then the
same computation with its shards; the checks run at TP=2 (two TP groups of 2) and TP=4.

Tolerance, fp32 on CPU: a TP layer adds the same products in another order (a row-
parallel layer sums per-rank partial dot products, the loss sums per-rank softmax
denominators), which changes a result by a few ulps per operation, ~1e-7 relative. We
compare each tensor by ||actual - expected|| / ||expected||: at most 1e-6 for one layer
and 1e-5 for a whole model (two layers' worth of rounding, through softmax and norms).
A wrong collective, a missing reduction or a shard taken from the wrong rows gives
errors of order 1. Initialisation is exact: the shards are cut from the same full tensor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tessera.config import ModelConfig, ParallelConfig
from tessera.models.documents import Documents
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.parallel.mesh import Mesh
from tessera.parallel.random import DropoutRNG
from tessera.parallel.sharding import ShardSpec, allreduce_sequence_parallel_grads, grad_norm_squared
from tessera.parallel.tensor import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy,
)
from tests.conftest import fused_as_on_gpus
from tests.dist.launcher import run_distributed

LAYER_TOLERANCE = 1e-6
MODEL_TOLERANCE = 1e-5
BATCH, SEQ, IN, OUT = 2, 8, 16, 24


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.detach() - expected.detach()).norm() / expected.detach().norm()).item()


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _chunk(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    return tensor.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


# -- layers ----------------------------------------------------------------------------

def _reference_linear(bias: bool, seed: int):
    """A full nn.Linear with seeded input, weights and output gradient, after its backward."""
    x_full = _randn(BATCH, SEQ, IN, seed=seed).requires_grad_()
    reference = nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(_randn(OUT, IN, seed=seed + 1))
        if bias:
            reference.bias.copy_(_randn(OUT, seed=seed + 2))
    y_full = reference(x_full)
    g_full = _randn(*y_full.shape, seed=seed + 3)
    (y_full * g_full).sum().backward()
    return x_full, reference, y_full, g_full


def _column(group, *, sp=False, bias=True, gather_output=False, segments=None, splits=None) -> dict:
    x_full, reference, y_full, g_full = _reference_linear(bias, seed=1)

    layer = ColumnParallelLinear(IN, OUT, bias=bias, init_std=0.02, segments=segments, splits=splits,
                                 tp_group=group, gather_output=gather_output, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.shard_spec.shard(reference.weight))
        if bias:
            layer.bias.copy_(layer.bias.shard_spec.shard(reference.bias))
    x = (_chunk(x_full, group, 1) if sp else x_full).detach().clone().requires_grad_()
    y = layer(x)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    out_spec = ShardSpec(tuple(y_full.shape), 2, segments, rank, size, splits)
    if gather_output:
        expected_y, g = y_full, g_full
    else:
        # A block replicated on several ranks (a KV group shared by their query heads) is
        # used once per rank: each use carries its share of the block's output gradient.
        share = torch.cat([torch.full((p.length,), 1.0 / p.replicas) for p in out_spec.pieces()])
        expected_y, g = out_spec.shard(y_full), out_spec.shard(g_full) * share
    (y * g).sum().backward()
    errors = {"output": _error(y, expected_y),
              "input grad": _error(x.grad, _chunk(x_full.grad, group, 1) if sp else x_full.grad),
              "weight grad": _error(layer.weight.grad, layer.weight.shard_spec.shard(reference.weight.grad))}
    if bias:
        errors["bias grad"] = _error(layer.bias.grad, layer.bias.shard_spec.shard(reference.bias.grad))
    return errors


def _row(group, *, sp=False, bias=True, input_is_parallel=True) -> dict:
    x_full, reference, y_full, g_full = _reference_linear(bias, seed=5)

    layer = RowParallelLinear(IN, OUT, bias=bias, init_std=0.02, tp_group=group,
                              input_is_parallel=input_is_parallel, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.shard_spec.shard(reference.weight))
        if bias:
            layer.bias.copy_(reference.bias)
    x = (_chunk(x_full, group, 2) if input_is_parallel else x_full).detach().clone().requires_grad_()
    y = layer(x)
    expected_y, g = (_chunk(y_full, group, 1), _chunk(g_full, group, 1)) if sp else (y_full, g_full)
    (y * g).sum().backward()
    allreduce_sequence_parallel_grads(layer, group)
    errors = {"output": _error(y, expected_y),
              "input grad": _error(x.grad, _chunk(x_full.grad, group, 2) if input_is_parallel else x_full.grad),
              "weight grad": _error(layer.weight.grad, layer.weight.shard_spec.shard(reference.weight.grad))}
    if bias:
        errors["bias grad"] = _error(layer.bias.grad, reference.bias.grad)
    return errors


def _embedding(group, *, sp=False) -> dict:
    vocab, hidden = 32, 8
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(9))
    reference = nn.Embedding(vocab, hidden)
    with torch.no_grad():
        reference.weight.copy_(_randn(vocab, hidden, seed=10))
    y_full = reference(ids)
    g_full = _randn(*y_full.shape, seed=11)
    (y_full * g_full).sum().backward()

    layer = VocabParallelEmbedding(vocab, hidden, init_std=0.02, tp_group=group, sequence_parallel=sp)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.shard_spec.shard(reference.weight))
    y = layer(ids)
    expected_y, g = (_chunk(y_full, group, 1), _chunk(g_full, group, 1)) if sp else (y_full, g_full)
    (y * g).sum().backward()
    return {"output": _error(y, expected_y),
            "weight grad": _error(layer.weight.grad, layer.weight.shard_spec.shard(reference.weight.grad))}


def _cross_entropy(group) -> dict:
    vocab = 64
    # Large logits: the loss must subtract the global max, not each rank's own.
    logits_full = (30 * _randn(BATCH, SEQ, vocab, seed=12)).requires_grad_()
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(13))
    weights = _randn(BATCH, SEQ, seed=14)
    expected = F.cross_entropy(logits_full.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    (expected * weights).sum().backward()

    logits = _chunk(logits_full, group, 2).detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, labels, group)
    (loss * weights).sum().backward()
    return {"loss": _error(loss, expected), "logits grad": _error(logits.grad, _chunk(logits_full.grad, group, 2)),
            "loss dtype is fp32": 0.0 if loss.dtype == torch.float32 else 1.0}


def _layer_checks(group) -> dict[str, dict]:
    tp = dist.get_world_size(group)
    return {
        f"column TP={tp}": _column(group),
        f"column TP={tp} SP": _column(group, sp=True),
        f"column TP={tp} no bias, gathered output": _column(group, bias=False, gather_output=True),
        # q 8, k 8, v 8 rows with the kv blocks cut in 2 however many ranks: replicated at TP=4.
        f"column TP={tp} fused q/k/v, 2 KV groups": _column(group, segments=(8, 8, 8), splits=(tp, 2, 2)),
        f"column TP={tp} SP fused q/k/v, 2 KV groups": _column(group, sp=True, segments=(8, 8, 8), splits=(tp, 2, 2)),
        f"row TP={tp}": _row(group),
        f"row TP={tp} SP": _row(group, sp=True),
        f"row TP={tp} input split here, no bias": _row(group, bias=False, input_is_parallel=False),
        f"embedding TP={tp}": _embedding(group),
        f"embedding TP={tp} SP": _embedding(group, sp=True),
        f"cross-entropy TP={tp}": _cross_entropy(group),
    }


# -- whole models ----------------------------------------------------------------------

MODELS = {
    # name: (preset, TP, sequence parallel, config overrides, recompute)
    "tiny-llama TP=2": ("tiny-llama", 2, False, {}, Recompute()),
    "tiny-llama TP=4 (2 KV groups over 4 ranks)": ("tiny-llama", 4, False, {}, Recompute()),
    "tiny-llama TP=2 SP": ("tiny-llama", 2, True, {}, Recompute()),
    "tiny-llama TP=4 SP, QKV bias, selective recompute": ("tiny-llama", 4, True, {"add_qkv_bias": True},
                                                          Recompute("selective")),
    "tiny-gpt TP=2 SP (biases, learned positions, tied)": ("tiny-gpt", 2, True, {}, Recompute()),
    "tiny-gpt TP=4 untied, full recompute": ("tiny-gpt", 4, False, {"untie_embeddings_and_output_weights": True},
                                             Recompute("full", "uniform", 1)),
}
# Run with the layers' fused CUDA paths (here through their torch code): SwiGLU fused into fc2.
FUSED_MODELS = {"tiny-llama TP=2 SP, SwiGLU fused into fc2": ("tiny-llama", 2, True, {}, Recompute())}


def _model_config(preset: str, overrides: dict, dropout: float = 0.0) -> ModelConfig:
    return ModelConfig(**{**PRESETS[preset], "hidden_dropout": dropout, "attention_dropout": dropout, **overrides})


def _inputs(config: ModelConfig, documents: bool) -> dict:
    generator = torch.Generator().manual_seed(15)
    tokens = torch.randint(0, config.vocab_size, (BATCH, config.seq_length), generator=generator)
    inputs = {"input_ids": tokens, "labels": torch.roll(tokens, -1, dims=1)}
    if documents:  # two documents per sample: positions restart, no attention across them
        document = (torch.arange(config.seq_length) >= config.seq_length // 3).long()
        inputs["position_ids"] = torch.arange(config.seq_length) - document * (config.seq_length // 3)
        inputs["position_ids"] = inputs["position_ids"].expand(BATCH, -1)
        s = config.seq_length
        cu_seqlens = torch.tensor([row * s + start for row in range(BATCH) for start in (0, s // 3)] + [BATCH * s])
        inputs["documents"] = Documents.from_cu_seqlens(cu_seqlens, BATCH, s, backend="per_document",
                                                        device=torch.device("cpu"))
    return inputs


def _model(group, preset: str, sp: bool, overrides: dict, recompute: Recompute, fused: bool = False) -> dict:
    """The TP model against the single-process one (with `fused`, the TP model takes the fused paths)."""
    config = _model_config(preset, overrides)
    inputs = _inputs(config, documents=preset == "tiny-gpt")
    weights = torch.rand(BATCH, config.seq_length, generator=torch.Generator().manual_seed(16))
    reference = GPTModel(config)
    initialize_parameters(reference, seed=5)
    expected_loss = reference(**inputs)
    (expected_loss * weights).sum().backward()
    expected_logits = reference(**{**inputs, "labels": None})

    model = GPTModel(config, tp_group=group, sequence_parallel=sp, recompute=recompute)
    initialize_parameters(model, seed=5)
    with fused_as_on_gpus() if fused else contextlib.nullcontext():
        loss = model(**inputs)
        (loss * weights).sum().backward()
        logits = model(**{**inputs, "labels": None})
    allreduce_sequence_parallel_grads(model, group)
    errors = {"loss": _error(loss, expected_loss), "logits": _error(logits, expected_logits)}
    expected = dict(reference.named_parameters())
    assert model.vocab_size == reference.vocab_size  # else the padding rows change the softmax
    for name, param in model.named_parameters():
        spec = param.shard_spec
        full = spec.unshard(_gather(param.detach(), group))
        errors[f"init {name}"] = (full - expected[name]).abs().max().item()  # exact
        errors[f"grad {name}"] = _error(spec.unshard(_gather(param.grad, group)), expected[name].grad)
        # Replicas (replicated parameters, KV groups shared by several ranks) hold equal gradients.
        errors[f"replicas agree {name}"] = (spec.shard(spec.unshard(_gather(param.grad, group))) - param.grad
                                            ).abs().max().item()
    squares = grad_norm_squared(list(model.parameters()), [p.grad for p in model.parameters()])
    dist.all_reduce(squares, group=group)
    expected_squares = sum(p.grad.square().sum() for p in reference.parameters())
    errors["grad norm"] = _error(squares.sqrt(), expected_squares.sqrt())
    return errors


# -- dropout randomness -----------------------------------------------------------------

def _same_on_all_ranks(tensor: torch.Tensor, group) -> bool:
    return all(torch.equal(t, tensor) for t in _gather(tensor, group))


def _all_different(tensor: torch.Tensor, group) -> bool:
    shards = _gather(tensor, group)
    return all(not torch.equal(a, b) for i, a in enumerate(shards) for b in shards[i + 1:])


def _rng_checks(group) -> dict[str, bool]:
    rank = dist.get_rank(group)
    ones = torch.ones(64, 64)
    torch.manual_seed(21)
    rng = DropoutRNG(21, rank)
    with rng.fork(ones.device):
        forked = F.dropout(ones, 0.5)
    default = F.dropout(ones, 0.5)
    checks = {"forked masks differ over TP ranks": _all_different(forked, group),
              "default masks agree over TP ranks": _same_on_all_ranks(default, group)}

    config = _model_config("tiny-gpt", {}, dropout=0.5)
    for sp in (False, True):
        torch.manual_seed(22)
        model = GPTModel(config, tp_group=group, sequence_parallel=sp).train()
        initialize_parameters(model, seed=5)
        tokens = torch.zeros(BATCH, config.seq_length, dtype=torch.long)  # same embedding everywhere
        dropped = model.embed(tokens) == 0
        mode = "SP" if sp else "no SP"
        residual_dropped = model.layers[0]._dropout(torch.ones(BATCH, 16, config.hidden_size)) == 0
        if sp:
            checks["SP: embedding dropout masks differ over sequence shards"] = _all_different(dropped, group)
            checks["SP: residual dropout masks differ over sequence shards"] = _all_different(residual_dropped, group)
        else:
            checks["no SP: embedding dropout masks agree over TP ranks"] = _same_on_all_ranks(dropped, group)
            checks["no SP: residual dropout masks agree over TP ranks"] = _same_on_all_ranks(residual_dropped, group)
        q = _randn(BATCH, model.layers[0].attention.num_heads, 16, 8, seed=23)
        checks[f"{mode}: attention dropout masks differ over TP ranks"] = _all_different(
            model.layers[0].attention.core(q, q, q, None), group)
        loss = model(tokens, labels=tokens)
        loss.sum().backward()
        checks[f"{mode}: loss with dropout agrees over TP ranks"] = _same_on_all_ranks(loss.detach(), group)
        checks[f"{mode}: default generator still agrees after a step"] = _same_on_all_ranks(torch.rand(8), group)

    # Recomputation replays the per-rank stream: same gradients as without recomputation.
    grads = []
    for recompute in (Recompute(), Recompute("full", "uniform", 1), Recompute("selective")):
        torch.manual_seed(24)
        model = GPTModel(config, tp_group=group, sequence_parallel=True, recompute=recompute).train()
        initialize_parameters(model, seed=5)
        model(tokens, labels=tokens).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    checks["SP: recomputed dropout replays the same masks"] = all(
        torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other))
    return checks


def _run_all() -> dict:
    results = {"layers": {}, "models": {}, "rng": {}}
    for tp in (2, 4):
        group = Mesh.build(ParallelConfig(tensor_model_parallel_size=tp), "cpu").tp_group
        results["layers"].update(_layer_checks(group))
        for name, (preset, model_tp, sp, overrides, recompute) in {**MODELS, **FUSED_MODELS}.items():
            if model_tp == tp:
                results["models"][name] = _model(group, preset, sp, overrides, recompute, fused=name in FUSED_MODELS)
        if tp == 2:
            results["rng"].update(_rng_checks(group))
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run_all, 4)


LAYER_NAMES = [f"{kind} TP={tp}{rest}" for tp in (2, 4) for kind, rest in [
    ("column", ""), ("column", " SP"), ("column", " no bias, gathered output"), ("column", " fused q/k/v, 2 KV groups"),
    ("column", " SP fused q/k/v, 2 KV groups"), ("row", ""), ("row", " SP"), ("row", " input split here, no bias"),
    ("embedding", ""), ("embedding", " SP"), ("cross-entropy", "")]]


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_layer_matches_single_process(results, name):
    for rank, result in enumerate(results):
        for quantity, error in result["layers"][name].items():
            assert error <= LAYER_TOLERANCE, f"rank {rank}: {name}: {quantity} differs by {error:.2e}"


@pytest.mark.parametrize("name", list(MODELS) + list(FUSED_MODELS))
def test_model_matches_single_process(results, name):
    for rank, result in enumerate(results):
        for quantity, error in result["models"][name].items():
            limit = 0.0 if quantity.startswith(("init", "replicas")) else MODEL_TOLERANCE
            assert error <= limit, f"rank {rank}: {name}: {quantity} differs by {error:.2e}"


def test_dropout_randomness(results):
    for rank, result in enumerate(results):
        failed = [check for check, ok in result["rng"].items() if not ok]
        assert not failed, f"rank {rank}: {failed}"

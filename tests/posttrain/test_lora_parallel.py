"""LoRA under tensor and sequence parallelism against one process (gloo, 2 processes, one launch).

Every rank builds the single-process LoRA model (TP=1) and the TP=2 one from the same seed, with
the same random B's (the step-0 B = 0 would leave A's gradient zero and hide a wrong cut of A), and
compares the loss, the logits and every adapter's full gradient; then merges both and compares
the merged logits with the unmerged. A PEFT adapter written by the single-process model imports
onto the TP=2 shards. Adapters go on every column-parallel (qkv, fc1) and
row-parallel (proj, fc2) layer. Tolerance as tests/dist/test_tensor_parallel.py's for a whole model
(relative 1e-5 in fp32: TP sums the same products in another order); the full A drawn at TP=2 must
equal TP=1's exactly, the shards being cut from the same full tensor.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from tessera.config import ModelConfig, ParallelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.interop.hf_peft import export_peft, import_peft
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.models.presets import PRESETS
from tessera.parallel.mesh import Mesh
from tessera.parallel.sharding import allreduce_sequence_parallel_grads
from tessera.posttrain.lora import adapter_state, apply_lora, merge_lora
from tests.conftest import fused_as_on_gpus
from tests.dist.launcher import run_distributed
from tests.posttrain.test_lora import randomize_adapters

TOLERANCE = 1e-5
LORA = PostTrainConfig(lora_rank=4, lora_alpha=8)
CASES = {   # name: (config overrides, sequence parallel, --tp-comm-overlap, fused paths as on GPUs)
    "TP=2": ({}, False, False, False),
    "TP=2 SP": ({}, True, False, False),
    "TP=2 SP, --tp-comm-overlap, SwiGLU fused into fc2 as on GPUs": ({}, True, True, True),
    "TP=2 SP, one KV group replicated on both ranks": ({"num_query_groups": 1}, True, False, False),
}


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.detach() - expected.detach()).norm() / expected.detach().norm()).item()


def _full(tensor: torch.Tensor, spec, group) -> torch.Tensor:
    shards = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, tensor.detach().contiguous(), group=group)
    return spec.unshard(shards)


def _lora_model(config: ModelConfig, group=None, sp: bool = False, overlap: bool = False,
                posttrain: PostTrainConfig = LORA, recompute: Recompute = Recompute()) -> GPTModel:
    torch.manual_seed(3)
    model = GPTModel(config, tp_group=group, sequence_parallel=sp, tp_comm_overlap=overlap, recompute=recompute)
    initialize_parameters(model, seed=5)
    apply_lora(model, posttrain, seed=5)
    return model


def _run(model: GPTModel, tokens: torch.Tensor, weights: torch.Tensor, group) -> tuple:
    loss = model(tokens, labels=torch.roll(tokens, -1, dims=1))
    (loss * weights).sum().backward()
    allreduce_sequence_parallel_grads(model, group)
    with torch.no_grad():
        return loss.detach(), model(tokens)


def _case(group, overrides: dict, sp: bool, overlap: bool, fused: bool) -> dict:
    config = ModelConfig(**{**PRESETS["tiny-llama"], **overrides})
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(7))
    weights = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(8))
    reference = _lora_model(config)
    expected_a = {name: p.detach().clone() for name, p in adapter_state(reference).items() if "lora_A" in name}
    randomize_adapters(reference, seed=9)
    expected_loss, expected_logits = _run(reference, tokens, weights, None)

    model = _lora_model(config, group, sp, overlap)
    state = adapter_state(model)
    errors = {f"init {name}": (_full(p, p.shard_spec, group) - expected_a[name]).abs().max().item()
              for name, p in state.items() if name in expected_a}
    randomize_adapters(model, seed=9)
    with fused_as_on_gpus() if fused else contextlib.nullcontext():
        loss, logits = _run(model, tokens, weights, group)
    errors.update({"loss": _error(loss, expected_loss), "logits": _error(logits, expected_logits)})
    expected = dict(reference.named_parameters())
    for name, param in state.items():
        spec, grad = param.shard_spec, _full(param.grad, param.shard_spec, group)
        errors[f"grad {name}"] = _error(grad, expected[name].grad)
        # Replicated parameters and pieces (A of qkv, a shared KV group's rows of B) agree over ranks.
        errors[f"replicas agree {name}"] = (spec.shard(grad) - param.grad).abs().max().item()
    errors["base has no gradients"] = float(any(p.grad is not None for n, p in model.named_parameters()
                                                if n not in state))
    merge_lora(reference)
    merge_lora(model)
    with torch.no_grad():
        errors["merged logits"] = _error(model(tokens), logits)
        errors["merged logits vs merged TP=1"] = _error(model(tokens), reference(tokens))
    return errors


def _dropout_replayed(group) -> dict:
    """With --lora-dropout and sequence parallelism the adapters draw per-rank masks: full
    recomputation must replay them, giving the gradients of the plain run bit for bit."""
    config = ModelConfig(**PRESETS["tiny-llama"])
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(7))
    posttrain = PostTrainConfig(lora_rank=4, lora_alpha=8, lora_dropout=0.5)
    grads = []
    for recompute in (Recompute(), Recompute("full", "uniform", 1)):
        model = _lora_model(config, group, sp=True, posttrain=posttrain, recompute=recompute).train()
        randomize_adapters(model, seed=9)
        model(tokens, labels=tokens).sum().backward()
        grads.append([p.grad for p in adapter_state(model).values()])
    return {"recomputed masks": float(not all(torch.equal(a, b) for a, b in zip(*grads)))}


def _peft_import(group, directory: str) -> dict:
    """A PEFT adapter exported from the single-process model imports onto each rank's shards."""
    config = ModelConfig(**PRESETS["tiny-llama"])
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(7))
    reference = _lora_model(config).eval()
    randomize_adapters(reference, seed=9)
    path = f"{directory}/rank{dist.get_rank()}"
    export_peft(reference, path)
    model = GPTModel(config, tp_group=group, sequence_parallel=True).eval()
    initialize_parameters(model, seed=5)
    import_peft(model, path)
    with torch.no_grad():
        return {"logits": _error(model(tokens), reference(tokens))}


def _run_all(directory: str) -> dict:
    group = Mesh.build(ParallelConfig(tensor_model_parallel_size=2), "cpu").tp_group
    results = {name: _case(group, *case) for name, case in CASES.items()}
    results["SP dropout, full recompute"] = _dropout_replayed(group)
    results["PEFT adapter imported at TP=2 SP"] = _peft_import(group, directory)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_run_all, 2, str(tmp_path_factory.mktemp("peft")))


@pytest.mark.parametrize("name", [*CASES, "SP dropout, full recompute", "PEFT adapter imported at TP=2 SP"])
def test_lora_matches_single_process(results, name):
    for rank, result in enumerate(results):
        for quantity, error in result[name].items():
            limit = TOLERANCE if quantity.startswith(("loss", "logits", "grad", "merged")) else 0.0
            assert error <= limit, f"rank {rank}: {name}: {quantity} differs by {error:.2e}"

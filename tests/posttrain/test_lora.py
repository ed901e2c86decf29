"""LoRA adapters in one process: the base model at step 0, only adapters train, the update
against a dense reference written here with plain torch (dropout where PEFT puts it), switching
adapters off, merging, and the compiled / recomputed / bf16 paths the trainer takes.

fp32 comparisons with a reference that adds the same products in another order allow 1e-6
relative; the step-0 model, the switched-off adapters and recomputation are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import ConfigError, ModelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.kernels.fp8 import Fp8Recipe
from tessera.models.gpt import GPTModel, Recompute, initialize_parameters
from tessera.models.mlp import MLP
from tessera.models.moe import GroupedExperts
from tessera.models.presets import PRESETS
from tessera.parallel.experts import ExpertGroups
from tessera.posttrain.lora import adapter_state, adapters, adapters_off, apply_lora, merge_lora
from tessera.training import fp8
from tests.conftest import fused_as_on_gpus

LORA = PostTrainConfig(lora_rank=4, lora_alpha=8)


def randomize_adapters(model: nn.Module, seed: int) -> None:
    """B ~ N(0, 0.1^2) from (seed, name), cut by its spec: the same full B for any layout."""
    with torch.no_grad():
        for name, param in adapter_state(model).items():
            if name.endswith("lora_B"):
                generator = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
                full = 0.1 * torch.randn(param.shard_spec.full_shape, generator=generator)
                param.copy_(param.shard_spec.shard(full))


def _model(preset: str, **overrides) -> GPTModel:
    model = GPTModel(ModelConfig(**{**PRESETS[preset], **overrides})).eval()
    initialize_parameters(model, seed=1)
    return model


def _tokens(model: GPTModel, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.detach() - expected.detach()).norm() / expected.detach().norm()).item()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
def test_step_zero_is_the_base_model(preset):
    model = _model(preset)
    tokens = _tokens(model)
    with torch.no_grad():
        expected = model(tokens)
    paths = apply_lora(model, LORA, seed=1)
    assert paths and all(adapter.lora_B.abs().sum() == 0 and adapter.lora_A.abs().sum() > 0
                         for adapter in adapters(model).values())
    with torch.no_grad():
        assert torch.equal(model(tokens), expected)


def test_only_adapters_train_and_the_base_stays_bit_identical():
    model = _model("tiny-llama").train()
    apply_lora(model, LORA, seed=1)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_state(model)) and len(trainable) == 2 * 8
    base = {name: p.detach().clone() for name, p in model.named_parameters() if name not in trainable}
    before = {name: p.detach().clone() for name, p in adapter_state(model).items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    tokens = _tokens(model)
    for _ in range(3):
        optimizer.zero_grad()
        model(tokens, labels=torch.roll(tokens, -1, 1)).mean().backward()
        optimizer.step()
    assert all(torch.equal(p, base[name]) for name, p in model.named_parameters() if name in base)
    assert all(p.grad is None for name, p in model.named_parameters() if name in base)
    assert all(not torch.equal(p, before[name]) for name, p in adapter_state(model).items())


class _Experts(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.experts = GroupedExperts(config, 0.02, groups=ExpertGroups())


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused as on GPUs"])
def test_dense_layers_against_a_reference_with_dropout_before_a(fused):
    """fc1 (column-parallel, gate and up fused) and fc2 (row-parallel, SwiGLU's output as its input):
    y = x W^T + alpha/r B A dropout(x), dropout on the adapter's input only; same masks as the
    reference's (the default generator, seeded alike). Fused as on GPUs, fc2 must not fuse SwiGLU
    into its GEMM: its adapter needs SwiGLU's output."""
    config = ModelConfig(**PRESETS["tiny-llama"])
    mlp = MLP(config, 0.02).train()
    initialize_parameters(mlp, seed=1)
    lora = PostTrainConfig(lora_rank=4, lora_alpha=12, lora_dropout=0.25, lora_target_modules=["fc1", "fc2"])
    apply_lora(mlp, lora, seed=1)
    randomize_adapters(mlp, seed=3)
    x = torch.randn(2, 8, config.hidden_size, generator=torch.Generator().manual_seed(4), requires_grad=True)
    torch.manual_seed(5)
    with fused_as_on_gpus() if fused else contextlib.nullcontext():
        y = mlp(x)
    y.square().sum().backward()

    fc1, fc2 = mlp.fc1, mlp.fc2
    weights = {name: p.detach().clone().requires_grad_() for name, p in adapter_state(mlp).items()}
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(5)
    h = x_ref @ fc1.weight.T + 3.0 * F.dropout(x_ref, 0.25) @ weights["fc1.adapter.lora_A"].T \
        @ weights["fc1.adapter.lora_B"].T
    gate, up = h.chunk(2, dim=-1)
    h = F.silu(gate) * up
    expected = h @ fc2.weight.T + 3.0 * F.dropout(h, 0.25) @ weights["fc2.adapter.lora_A"].T \
        @ weights["fc2.adapter.lora_B"].T
    expected.square().sum().backward()
    assert _error(y, expected) <= 1e-6
    assert _error(x.grad, x_ref.grad) <= 1e-6
    for name, param in adapter_state(mlp).items():
        assert _error(param.grad, weights[name].grad) <= 1e-6, name


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_expert_adapters_against_a_per_expert_reference(grouped_gemm):
    config = ModelConfig(**{**PRESETS["tiny-moe"], "moe_grouped_gemm": grouped_gemm})
    module = _Experts(config)
    initialize_parameters(module, seed=1)
    lora = PostTrainConfig(lora_rank=4, lora_alpha=8, lora_target_modules=["linear_fc1", "linear_fc2"])
    assert apply_lora(module, lora, seed=1) == ["experts.fc1", "experts.fc2"]
    randomize_adapters(module, seed=3)
    generator = torch.Generator().manual_seed(4)
    tokens_per_expert = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, config.hidden_size, generator=generator)
    probs = torch.rand(10, generator=generator)
    y = module.experts(x, tokens_per_expert, probs)

    experts, a1, b1, a2, b2 = (module.experts, *adapter_state(module).values())
    rows = []
    for e, (part, p) in enumerate(zip(x.split(tokens_per_expert.tolist()), probs.split(tokens_per_expert.tolist()))):
        h = part @ experts.fc1[e].T + 2.0 * part @ a1[e].T @ b1[e].T
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up * p.unsqueeze(-1)
        rows.append(h @ experts.fc2[e].T + 2.0 * h @ a2[e].T @ b2[e].T)
    assert _error(y, torch.cat(rows)) <= 1e-6


def test_adapters_off_gives_the_base_model():
    model = _model("tiny-moe")
    tokens = _tokens(model)
    with torch.no_grad():
        expected = model(tokens)
        apply_lora(model, LORA, seed=1)
        randomize_adapters(model, seed=3)
        adapted = model(tokens)
        with adapters_off(model):
            assert torch.equal(model(tokens), expected)
        assert torch.equal(model(tokens), adapted) and not torch.equal(adapted, expected)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
def test_merge_reproduces_the_adapted_model_with_plain_layers(preset):
    model = _model(preset)
    names = [name for name, _ in model.named_parameters()]
    tokens = _tokens(model)
    paths = apply_lora(model, LORA, seed=1)
    randomize_adapters(model, seed=3)
    with torch.no_grad():
        adapted = model(tokens)
        assert merge_lora(model) == paths
        merged = model(tokens)
    assert not adapters(model) and [name for name, _ in model.named_parameters()] == names
    assert _error(merged, adapted) <= 1e-6


def test_merge_refuses_fp8_weights():
    model = _model("tiny-llama")
    apply_lora(model, LORA, seed=1)
    layer = model.layers[0].attention.qkv
    layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="FP8"):
        merge_lora(model)


def test_full_recompute_compiled_block_and_bf16_autocast():
    """The trainer's paths: full recomputation gives the same gradients bit for bit; a block
    compiled whole (fullgraph: the adapters break no graph) the eager one's, adapters switched off
    inside it too; bf16 autocast runs the adapters in bf16 beside the base. The compiled block is
    traced by Dynamo and AOTAutograd (aot_eager): Inductor's code generation, 20 s on the CPU, adds
    nothing of the adapters' own (tests/training/test_trainer.py compiles blocks with it)."""
    config = ModelConfig(**PRESETS["tiny-llama"])
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    grads, logits = [], []
    for recompute, compiled in ((Recompute(), False), (Recompute("full", "uniform", 1), False), (Recompute(), True)):
        model = GPTModel(config, recompute=recompute).train()
        initialize_parameters(model, seed=1)
        apply_lora(model, LORA, seed=1)
        randomize_adapters(model, seed=3)
        if compiled:
            model.layers[0].compile(backend="aot_eager", fullgraph=True)
        model(tokens, labels=tokens).sum().backward()
        grads.append([p.grad for p in adapter_state(model).values()])
        with torch.no_grad(), adapters_off(model):
            logits.append(model(tokens))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    assert all(_error(a, b) <= 1e-5 for a, b in zip(grads[0], grads[2]))
    assert torch.equal(logits[0], logits[1]) and _error(logits[2], logits[0]) <= 1e-5

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        bf16 = model(tokens)
    with torch.no_grad():
        fp32 = model(tokens)
    assert bf16.dtype == torch.bfloat16 and _error(bf16.float(), fp32) <= 2e-2


def test_fp8_gemms_of_the_base_beside_unquantised_adapters():
    """--fp8-format puts the base's GEMMs in FP8 (tessera.training.fp8); the adapters stay in the
    model's dtype beside them: B = 0 gives the FP8 base exactly, and an FP8 layer's update and its
    adapter's gradients are the unquantised reference's."""
    model = _model("tiny-llama")
    tokens = _tokens(model)
    apply_lora(model, LORA, seed=1)
    fp8.apply_fp8(model.layers.items(), Fp8Recipe(recipe="tensorwise"), set(), tokens.numel())
    with torch.no_grad():
        base = model(tokens)
        with adapters_off(model):
            assert torch.equal(model(tokens), base)
    randomize_adapters(model, seed=3)
    layer = model.layers[0].mlp.fc1
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), adapters_off(model):
        y_base = layer(x)
    y = layer(x)
    a, b = (p.detach().clone().requires_grad_() for p in (layer.adapter.lora_A, layer.adapter.lora_B))
    update = 2.0 * x @ a.T @ b.T
    assert layer.fp8 is not None and _error(y - y_base, update) <= 1e-6
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y * g).sum().backward()
    (update * g).sum().backward()
    assert _error(layer.adapter.lora_A.grad, a.grad) <= 1e-6 and _error(layer.adapter.lora_B.grad, b.grad) <= 1e-6


def test_refusals_are_one_line():
    model = _model("tiny-moe")
    with pytest.raises(ConfigError, match="--lora-rank"):
        apply_lora(model, PostTrainConfig(), seed=1)
    apply_lora(model, LORA, seed=1)
    with pytest.raises(ConfigError, match="already"):
        apply_lora(model, LORA, seed=1)
    model.layers[1].mlp.experts.fp8 = object()   # as --fp8-experts sets it
    with pytest.raises(ConfigError, match="--fp8-experts"):
        model(_tokens(model))
    cut = _model("tiny-moe")   # experts cut by --expert-tensor-parallel-size 2, as rank 0 holds them
    experts = cut.layers[1].mlp.experts
    experts.fc1.shard_spec = dataclasses.replace(experts.fc1.shard_spec, size=2)
    with pytest.raises(ConfigError, match="layers.1.mlp.experts.fc1 is cut by --expert-tensor-parallel-size 2"):
        apply_lora(cut, LORA, seed=1)

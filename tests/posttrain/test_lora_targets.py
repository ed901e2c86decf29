"""--lora-target-modules and --lora-exclude-modules select exactly the layers they name, in
Megatron-Core's names and paths or tessera's, MoE experts included, on any pipeline stage."""

from __future__ import annotations

import pytest

from tessera.config import ConfigError, ModelConfig
from tessera.config.posttrain import PostTrainConfig
from tessera.models.gpt import GPTModel
from tessera.models.presets import PRESETS
from tessera.posttrain.lora import adapter_state, apply_lora


def _adapted(preset: str, targets: list[str] | None = None, excludes: list[str] | None = None,
             **stage) -> list[str]:
    model = GPTModel(ModelConfig(**PRESETS[preset]), **stage)
    lora = PostTrainConfig(lora_rank=2, **({"lora_target_modules": targets} if targets else {}),
                           lora_exclude_modules=excludes)
    paths = apply_lora(model, lora, seed=0)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable == set(adapter_state(model)) and len(trainable) == 2 * len(paths)
    return paths


def _layers(indices, *modules: str) -> list[str]:
    return [f"layers.{i}.{module}" for i in indices for module in modules]


@pytest.mark.parametrize("targets, excludes, expected", [
    (None, None, _layers(range(2), "attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")),
    (["*.layers.0.*.linear_qkv"], None, ["layers.0.attention.qkv"]),
    (["linear_qkv", "linear_fc2"], ["*.layers.1.*"], ["layers.0.attention.qkv", "layers.0.mlp.fc2"]),
    (["layers.1.attention.proj", "fc1"], None, ["layers.0.mlp.fc1", "layers.1.attention.proj", "layers.1.mlp.fc1"]),
    (["decoder.layers.*.self_attention.*"], ["linear_proj"], _layers(range(2), "attention.qkv")),
])
def test_dense_targets_and_exclusions(targets, excludes, expected):
    assert _adapted("tiny-llama", targets, excludes) == expected


def test_moe_experts_are_targets_too():
    """tiny-moe: layer 0 dense, layers 1-3 MoE with routed experts (one adapter per expert of
    each of fc1 and fc2) and a shared expert."""
    moe = ["mlp.experts.fc1", "mlp.experts.fc2", "mlp.shared_expert.fc1", "mlp.shared_expert.fc2"]
    assert _adapted("tiny-moe", ["linear_fc1", "linear_fc2"]) == ["layers.0.mlp.fc1", "layers.0.mlp.fc2",
                                                                  *_layers(range(1, 4), *moe)]
    assert _adapted("tiny-moe", ["*.mlp.experts.linear_fc1"]) == _layers(range(1, 4), "mlp.experts.fc1")
    assert _adapted("tiny-moe", ["linear_fc2"], ["*.experts.*"]) == [
        "layers.0.mlp.fc2", *_layers(range(1, 4), "mlp.shared_expert.fc2")]


def test_a_pipeline_stage_takes_its_own_layers():
    stage = dict(layer_indices=[2, 3], pre_process=False)
    assert _adapted("tiny-moe", ["*.layers.0.*.linear_qkv"], **stage) == []   # layer 0 is another stage's
    assert _adapted("tiny-moe", ["linear_qkv"], **stage) == _layers((2, 3), "attention.qkv")


@pytest.mark.parametrize("preset, targets, excludes, flag", [
    ("tiny-llama", ["linear_qvk"], None, "--lora-target-modules: 'linear_qvk' names no layer"),
    ("tiny-llama", ["*.layers.7.*"], None, "--lora-target-modules: '\\*.layers.7.\\*' names no layer"),
    ("tiny-llama", None, ["*.layers.9.*"], "--lora-exclude-modules: '\\*.layers.9.\\*' names no layer"),
    ("tiny-llama", ["*.experts.*"], None, "--lora-target-modules: '\\*.experts.\\*' names no layer"),
    # Multi-latent attention has no fused QKV: its layers are named in the message
    ("tiny-deepseek", None, None, "'linear_qkv' names no layer .*linear_kv_up_proj"),
])
def test_a_pattern_naming_nothing_is_one_line(preset, targets, excludes, flag):
    with pytest.raises(ConfigError, match=flag) as error:
        _adapted(preset, targets, excludes)
    assert "\n" not in str(error.value)

"""Hugging Face Nemotron-H against transformers itself: a tiny random NemotronHForCausalLM with every
kind of layer (Mamba-2, attention, squared-ReLU MLP, MoE with a grouped sigmoid router), built from a
config (nothing downloaded), its logits through tessera, and the exact round trip through `tessera
convert`. transformers runs its PyTorch scan here (no mamba-ssm on the CPU)."""

import pytest
import torch
import transformers

from tessera.config import ModelConfig
from tessera.interop.hf import read_hf_dir, tessera_state_from_hf
from tessera.interop.hf_config import hf_config_from_model, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel
from tessera.models.presets import preset_values
from tests.interop.conversions import assert_logits_match, round_trip

VOCAB = 101   # not a multiple of anything: padded on import, cut on export
LAYERS = ["linear_attention", "full_attention", "mlp", "moe", "linear_attention", "moe"]


def _config(**extra) -> transformers.NemotronHConfig:
    # 8 experts in 4 groups, 2 groups a token, top-4: HF's group score (its best two) is Megatron's
    return transformers.NemotronHConfig(**{
        **dict(vocab_size=VOCAB, hidden_size=64, layers_block_type=LAYERS, num_attention_heads=4, num_key_value_heads=2,
               head_dim=24, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
               chunk_size=8, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
               moe_intermediate_size=48, moe_shared_expert_intermediate_size=32, routed_scaling_factor=2.5,
               max_position_embeddings=64), **extra})


def _hf_model(path=None, **extra):
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(_config(**extra)).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():   # norms, D and biases away from their init, decisive routers: mix-ups would show
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("gate.weight"):
                tensor.normal_(0.0, 0.5, generator=generator)
            elif "norm" in name or name.endswith((".D", "bias")):
                tensor.normal_(0.5, 0.1, generator=generator)
    if path is not None:
        model.save_pretrained(path)
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))


def test_logits_match_transformers(tmp_path):
    assert_logits_match(_hf_model(tmp_path), tmp_path, _ids())


def test_transformers_in_memory_names_and_fused_experts_map_as_the_files_do(tmp_path):
    reference = _hf_model(tmp_path)
    hf_config, on_disk = read_hf_dir(tmp_path)   # backbone.*, one tensor per expert
    in_memory = reference.state_dict()           # model.*, experts fused [E, I, H]
    assert any(name.startswith("model.") for name in in_memory) and "model.layers.3.mixer.experts.up_proj" in in_memory
    config = model_config_from_hf(hf_config)
    from_disk, from_memory = (tessera_state_from_hf(hf_config, tensors, config) for tensors in (on_disk, in_memory))
    assert from_disk.keys() == from_memory.keys()
    assert all(torch.equal(from_disk[name], from_memory[name]) for name in from_disk)


def test_round_trip_through_a_tessera_checkpoint_is_exact(tmp_path):
    reference = _hf_model(tmp_path / "hf")
    export = round_trip(tmp_path / "hf", tmp_path)
    assert export.config["layers_block_type"] == LAYERS and export.config["model_type"] == "nemotron_h"
    with torch.no_grad():
        assert torch.equal(export.model(_ids()).logits, reference(_ids()).logits)


def test_the_older_pattern_field_reads_as_layers_block_type():
    fields = {k: v for k, v in _config().to_dict().items() if k != "layers_block_type"}
    assert model_config_from_hf({**fields, "hybrid_override_pattern": "M*-EME"}).hybrid_layer_pattern == "M*-EME"
    legacy = {**fields, "layers_block_type": ["mamba", "attention", "mlp", "moe"]}   # transformers' earlier names
    assert model_config_from_hf(legacy).hybrid_layer_pattern == "M*-E"


@pytest.mark.parametrize("field, value", [("mlp_hidden_act", "silu"), ("mamba_hidden_act", "gelu"),
                                          ("mlp_bias", True), ("moe_latent_size", 16), ("tie_word_embeddings", True),
                                          ("conv_kernel", 3), ("topk_group", 1)])
def test_what_tessera_computes_differently_is_refused(field, value):
    with pytest.raises(UnsupportedModel, match=field):
        model_config_from_hf({**_config().to_dict(), field: value})


@pytest.mark.parametrize("field, value", [("squared_relu", False), ("attention_output_gate", True),
                                          ("layernorm_zero_centered_gamma", True)])
def test_a_hybrid_nemotron_h_does_not_compute_is_refused_naming_the_flag(field, value):
    model = ModelConfig(**{**preset_values("tiny-nemotron-h"), field: value})
    with pytest.raises(UnsupportedModel, match=f"--{field.replace('_', '-')} {value} has no Hugging Face equivalent"):
        hf_config_from_model(model, "nemotron_h")

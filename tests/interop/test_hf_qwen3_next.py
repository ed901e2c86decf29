"""Hugging Face Qwen3-Next against transformers itself: a tiny random Qwen3NextForCausalLM (Gated
DeltaNet and gated full attention, MoE with a gated shared expert and a dense layer; built from a
config, nothing downloaded), its logits through tessera, and the exact round trip through
`tessera convert`. transformers runs its PyTorch delta rule here (no flash-linear-attention)."""

import pytest
import torch
import transformers

from tessera.interop.hf_config import hf_config_from_model, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel
from tests.interop.conversions import assert_logits_match, round_trip

VOCAB = 101   # not a multiple of anything: padded on import, cut on export


def _config(**extra) -> transformers.Qwen3NextConfig:
    return transformers.Qwen3NextConfig(**{**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[2], layer_types=["linear_attention", "full_attention",
                                                                             "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}), **extra})


def _hf_model(path, **extra):
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(_config(**extra)).eval()
    with torch.no_grad():   # norms (zero-centred and plain) away from their initial values: mix-ups would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "shared_expert_gate.weight")):
                param.normal_(0.3, 0.2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied, tmp_path):
    reference = _hf_model(tmp_path, tie_word_embeddings=tied)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    assert assert_logits_match(reference, tmp_path, ids).config.hybrid_layer_pattern == "GE*EG-*E"


def test_round_trip_through_a_tessera_checkpoint_is_exact(tmp_path):
    _hf_model(tmp_path / "hf")
    export = round_trip(tmp_path / "hf", tmp_path)
    assert export.config["layer_types"] == export.original_config["layer_types"]
    assert export.config["mlp_only_layers"] == [2]


def test_a_pattern_that_is_not_mixer_mlp_pairs_has_no_export():
    model = model_config_from_hf(_config().to_dict())
    model.hybrid_layer_pattern = "GG*EG-*E"
    with pytest.raises(UnsupportedModel, match="pairs of a mixer"):
        hf_config_from_model(model, "qwen3_next")

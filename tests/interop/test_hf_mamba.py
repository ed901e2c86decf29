"""Hugging Face Mamba-2 against transformers itself: a tiny random Mamba2ForCausalLM (built from a
config, nothing downloaded), its logits through tessera, and the exact round trip through
`tessera convert`. transformers runs its PyTorch scan here (no mamba-ssm on the CPU)."""

import pytest
import torch
import transformers

from tessera.config import ModelConfig
from tessera.interop.hf_config import hf_config_from_model, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel
from tests.interop.conversions import assert_logits_match, round_trip

VOCAB = 101   # not a multiple of anything: padded on import, cut on export


def _config(**extra) -> transformers.Mamba2Config:
    return transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_heads=8, head_dim=8, state_size=4,
                                     n_groups=2, num_hidden_layers=2, chunk_size=8, **extra)


def _hf_model(path, **extra):
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(_config(**extra)).eval()
    with torch.no_grad():   # norms and D away from one, biases away from zero: mix-ups would show
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith((".D", "bias")):
                param.normal_(0.5, 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied, tmp_path):
    reference = _hf_model(tmp_path, tie_word_embeddings=tied)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    assert_logits_match(reference, tmp_path, ids)


def test_round_trip_through_a_tessera_checkpoint_is_exact(tmp_path):
    _hf_model(tmp_path / "hf", use_bias=True)
    export = round_trip(tmp_path / "hf", tmp_path)
    assert export.config["model_type"] == "mamba2" and export.config["num_heads"] == export.original_config["num_heads"]


@pytest.mark.parametrize("field, value", [("conv_kernel", 3), ("use_conv_bias", False), ("hidden_act", "gelu"),
                                          ("time_step_limit", [0.0, 1.0])])
def test_what_tessera_computes_differently_is_refused(field, value):
    with pytest.raises(UnsupportedModel, match=field):
        model_config_from_hf({**_config().to_dict(), field: value})


def test_a_pattern_with_other_layers_has_no_mamba2_export():
    model = ModelConfig(hybrid_layer_pattern="M*-", hidden_size=32, num_attention_heads=4, seq_length=16,
                        mamba_head_dim=8, mamba_num_groups=2, vocab_size=VOCAB, normalization="RMSNorm",
                        position_embedding_type="none", squared_relu=True, disable_bias_linear=True,
                        untie_embeddings_and_output_weights=True)
    with pytest.raises(UnsupportedModel, match="a nemotron_h model, not mamba2"):
        hf_config_from_model(model, "mamba2")

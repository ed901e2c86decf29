"""RoPE scaling in Hugging Face configs <-> tessera's flags. The logits of scaled Llama and
Qwen2 models and their exact round trip run with the other families in test_hf.py
("llama3.1-rope-scaling", "qwen2.5-yarn"); here: both transformers versions' keys, HF's
fallbacks, what is refused, and that transformers' own rope initialisation computes
tessera's frequencies from the exported config.
"""

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tessera.config import ModelConfig
from tessera.interop.hf_config import hf_config_from_model, infer_family, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel, rope_fields_from_hf
from tessera.models.rope import build_rotary, rope_scaling
from tests.interop.test_hf import _LLAMA, LLAMA3_ROPE, YARN_ROPE

LLAMA = dict(model_type="llama", **dict(_LLAMA, max_position_embeddings=128))


def _scaling_fields(config: ModelConfig) -> dict:
    return {name: value for name, value in vars(config).items()
            if name.startswith(("rope", "yarn", "mscale", "use_rope", "rotary_"))}


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, YARN_ROPE], ids=["llama3", "yarn"])
def test_both_transformers_versions_keys_give_the_same_model(rope):
    v5 = model_config_from_hf(dict(LLAMA, rope_parameters=rope))
    scaling = {k: v for k, v in rope.items() if k not in ("rope_type", "rope_theta")}
    v4 = model_config_from_hf(dict(LLAMA, rope_theta=rope["rope_theta"],
                                   rope_scaling={"type": rope["rope_type"], **scaling}))
    assert _scaling_fields(v4) == _scaling_fields(v5)
    assert rope_scaling(v5) is not None


ALL_YARN_FIELDS = dict(YARN_ROPE, mscale=0.8, mscale_all_dim=0.6, truncate=False, beta_fast=16.0, beta_slow=2.0)


@pytest.mark.parametrize("rope", [LLAMA3_ROPE, YARN_ROPE, ALL_YARN_FIELDS], ids=["llama3", "yarn", "yarn all fields"])
def test_export_is_what_transformers_computes_and_imports_back(rope):
    model = model_config_from_hf(dict(LLAMA, rope_parameters=rope))
    exported = hf_config_from_model(model, infer_family(model))
    assert exported["rope_scaling"] == {k: v for k, v in exported["rope_parameters"].items() if k != "rope_theta"}
    hf = transformers.LlamaConfig(**{k: v for k, v in exported.items() if k not in ("rope_scaling", "dtype")})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    rotary = build_rotary(model)
    angles = torch.arange(128, dtype=torch.float64)[:, None] * inv_freq.double()
    torch.testing.assert_close(rotary.cos.double(), torch.cat([angles, angles], -1).cos() * factor, rtol=0, atol=1e-5)
    assert _scaling_fields(model_config_from_hf(exported)) == _scaling_fields(model)


def test_hf_fallbacks():
    # no factor: max_position_embeddings / original (transformers 5); one mscale only: HF's mscale(factor, 1)
    fields = rope_fields_from_hf(dict(LLAMA, rope_parameters=dict(rope_type="yarn", rope_theta=1e4,
                                                                   original_max_position_embeddings=32, mscale=0.7)))
    assert (fields["rotary_scaling_factor"], fields["mscale"], fields["mscale_all_dim"]) == (4.0, 1.0, 0.0)
    config = dict(LLAMA, rope_parameters=dict(YARN_ROPE, mscale=0.7))
    _, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**{k: v for k, v in config.items()
                                                                          if k != "model_type"}))
    assert rope_scaling(model_config_from_hf(config)).attention_factor == pytest.approx(hf_factor, rel=1e-12)


def test_what_tessera_cannot_say_is_refused():
    with pytest.raises(UnsupportedModel, match="attention_factor"):
        model_config_from_hf(dict(LLAMA, rope_parameters=dict(YARN_ROPE, attention_factor=1.5)))
    with pytest.raises(UnsupportedModel, match="mscale_all_dim"):
        rope_fields_from_hf(dict(LLAMA, rope_parameters=dict(YARN_ROPE, mscale_all_dim=1.0)),
                            multi_latent_attention=True)
    model = model_config_from_hf(dict(LLAMA, rope_parameters=YARN_ROPE))
    model.mscale = 0.9   # cos/sin factor mscale(s, 0.9): HF has no way to write it
    with pytest.raises(UnsupportedModel, match="--mscale 0.9"):
        hf_config_from_model(model, "llama")
    mla = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=32,
                      position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
                      multi_latent_attention=True)
    with pytest.raises(UnsupportedModel):   # not a Llama, whatever else it shares with one
        infer_family(mla)

"""Hugging Face GPT-OSS against transformers itself: a tiny random GptOssForCausalLM (nothing
downloaded) with sinks, alternating sliding windows shorter than the sequence, YaRN, biased
experts with the clamped gate, and a router bias.

transformers runs its eager attention (sinks concatenated to the scores) and its eager experts
loop. Weights are drawn wider than HF's init (std 0.1; sinks, biases and norms away from their
defaults; router 0.5), so that a wrong interleave, window or sink moves the logits far beyond
the 1e-4 bound and near-ties between experts are unlikely. fp32 logits agree to about 1e-6.
"""

import pytest
import torch
import transformers

from tessera.inference.generate import generate
from tessera.interop.hf import load_hf
from tessera.interop.hf_config import infer_family, model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel
from tessera.models.presets import preset_values
from tessera.config import ModelConfig
from tests.interop.conversions import assert_logits_match, round_trip

VOCAB = 101
SEQ = 24


def tiny_gpt_oss_config(**overrides) -> transformers.GptOssConfig:
    """3 layers (windowed, full, windowed), window 5 < SEQ, 4 experts top-2, YaRN x4 from 16 tokens."""
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    return transformers.GptOssConfig(**{**fields, **overrides})


def tiny_gpt_oss(seed: int = 0, **overrides):
    """An eager transformers GptOssForCausalLM drawn so that mix-ups show."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_gpt_oss_config(**overrides),
                                                          experts_implementation="eager").eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1, generator=generator)
            elif name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5 if name.endswith("sinks") else 0.1, generator=generator)
            elif name.endswith("router.weight"):
                param.normal_(0.0, 0.5, generator=generator)
            else:
                param.normal_(0.0, 0.1, generator=generator)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = tiny_gpt_oss()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return model, path


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_the_config_maps_onto_megatrons_flags(saved):
    _, path = saved
    config = load_hf(path).config
    assert (config.softmax_type, config.window_size, config.window_attn_skip_freq) == ("learnable", (4, 0), "2")
    assert config.window_layers() == [4, None, 4]
    assert (config.quick_geglu, config.glu_linear_offset, config.activation_func_clamp_value) == (True, 1.0, 7.0)
    assert (config.rope_type, config.yarn_correction_range_round_to_int) == ("yarn", False)
    assert config.add_bias_linear and infer_family(config) == "gpt_oss"


def test_logits_match_transformers(saved):
    reference, path = saved
    assert_logits_match(reference, path, _ids())
    # The window matters at this length: the same weights with full attention everywhere differ.
    with torch.no_grad():
        full = tiny_gpt_oss(layer_types=["full_attention"] * 3)(_ids()).logits
        assert (full - reference(_ids()).logits).abs().max().item() > 1e-2


def test_round_trip_through_a_tessera_checkpoint_is_exact(saved, tmp_path):
    _, path = saved
    assert not round_trip(path, tmp_path).changed_fields()


@pytest.mark.parametrize("overrides, message", [
    ({"swiglu_alpha": 1.0}, "swiglu_alpha 1.0"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types"),
])
def test_what_tessera_computes_differently_is_refused(overrides, message):
    with pytest.raises(UnsupportedModel, match=message):
        model_config_from_hf(tiny_gpt_oss_config(**overrides).to_dict())


def test_the_presets_are_gpt_oss_models():
    for name in ("gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"):
        assert infer_family(ModelConfig(**preset_values(name))) == "gpt_oss", name


def test_greedy_generation_matches_transformers(saved):
    """Prompts longer than the window, then decode steps through the paged KV cache: windowed
    layers must drop the keys that fell out of the window, and every step keep the sinks."""
    reference, path = saved
    prompt = _ids()[:, :12]
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=10, do_sample=False,
                                      attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(generate(load_hf(path), prompt, max_new_tokens=10, temperature=0), expected)

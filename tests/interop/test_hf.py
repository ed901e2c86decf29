"""Hugging Face interop against transformers itself: tiny random models of each family,
built from configs (nothing downloaded).

Logits: tessera and transformers compute the same fp32 maths in a different order
(fused QKV GEMM, RoPE tables in float64 vs float32), so they agree to rounding, well
inside the 1e-4 bound. The round trip HF -> tessera -> HF must be bit-exact.
"""

import pytest
import torch
import transformers

from tessera.cli import run
from tessera.interop.hf import read_hf_dir
from tessera.interop.hf_config import model_config_from_hf
from tessera.interop.hf_fields import UnsupportedModel
from tests.interop.conversions import assert_logits_match, round_trip

VOCAB = 101  # not a multiple of anything: exercises padding on import and cutting on export
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=32)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
FAMILIES = {
    "llama3-gqa-untied": lambda: transformers.LlamaConfig(**_LLAMA, num_key_value_heads=2, rope_theta=500000.0),
    "llama2-mha-tied": lambda: transformers.LlamaConfig(**_LLAMA, num_key_value_heads=4, tie_word_embeddings=True),
    "mistral-gqa": lambda: transformers.MistralConfig(**_LLAMA, num_key_value_heads=2, rope_theta=1e6,
                                                      sliding_window=None),
    "qwen2-qkv-bias-tied": lambda: transformers.Qwen2Config(**_LLAMA, num_key_value_heads=1, rope_theta=1e6,
                                                            tie_word_embeddings=True),
    "qwen2-untied": lambda: transformers.Qwen2Config(**_LLAMA, num_key_value_heads=2, tie_word_embeddings=False),
    # RoPE scaling (tests/interop/test_hf_rope.py): the frequencies of 16-channel heads fall in
    # all three of llama3's bands, and across YaRN's ramp
    "llama3.1-rope-scaling": lambda: transformers.LlamaConfig(**dict(_LLAMA, max_position_embeddings=128),
                                                              num_key_value_heads=2, rope_parameters=LLAMA3_ROPE),
    "qwen2.5-yarn": lambda: transformers.Qwen2Config(**dict(_LLAMA, max_position_embeddings=128),
                                                     num_key_value_heads=2, rope_parameters=YARN_ROPE),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                            bos_token_id=0, eos_token_id=0),
}


def _hf_model(family: str, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    with torch.no_grad():  # random biases and norm weights: zeros and ones would hide mix-ups
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                param.normal_(0.5 if "norm" in name or "ln_" in name else 0.0, 0.1)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tmp_path):
    reference = _hf_model(family, tmp_path)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    assert_logits_match(reference, tmp_path, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_a_tessera_checkpoint_is_exact(family, tmp_path):
    _hf_model(family, tmp_path / "hf")
    tokenizer_files = {"tokenizer.json": b'{"version": "1.0"}', "tokenizer.model": bytes(range(256))}
    for name, content in tokenizer_files.items():
        (tmp_path / "hf" / name).write_bytes(content)
    export = round_trip(tmp_path / "hf", tmp_path)
    # the tokenizer (and generation config) travel with the weights, both ways, byte for byte
    for name in [*tokenizer_files, "generation_config.json"]:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    assert export.config["model_type"] == export.original_config["model_type"]


def test_large_models_are_written_in_shards_with_an_index(tmp_path):
    _hf_model("llama2-mha-tied", tmp_path / "hf")
    run(["convert", "hf-to-tessera", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")])
    run(["convert", "tessera-to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"),
         "--max-shard-size-gb", str(40_000 / 2**30)])
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    _, original = read_hf_dir(tmp_path / "hf")
    _, tensors = read_hf_dir(tmp_path / "out")
    assert all(torch.equal(tensors[k], v) for k, v in original.items())


def test_rope_theta_is_read_from_either_transformers_version():
    v4 = dict(model_type="llama", **_LLAMA, rope_theta=123.0)
    v5 = dict(model_type="llama", **_LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 456.0})
    assert model_config_from_hf(v4).rotary_base == 123.0
    assert model_config_from_hf(v5).rotary_base == 456.0


def test_features_tessera_does_not_compute_are_refused():
    scaled = dict(model_type="llama", **_LLAMA, rope_scaling={"rope_type": "dynamic", "factor": 8.0})
    with pytest.raises(UnsupportedModel, match="dynamic"):
        model_config_from_hf(scaled)
    with pytest.raises(UnsupportedModel, match="sliding_window"):
        model_config_from_hf(dict(model_type="mistral", **_LLAMA, sliding_window=16))

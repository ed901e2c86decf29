"""Which models the fused single-request decode step (tessera.inference.fused_decode) takes: only
those whose every layer on the decode path is one it computes. Its kernels and its logits are
tested on a GPU (tests/gpu/test_decode_kernels_cuda.py)."""

import pytest

from tessera.config import ModelConfig
from tessera.inference import fused_decode
from tessera.models.gpt import GPTModel
from tessera.models.presets import preset_values


def _model(preset: str, **changes) -> GPTModel:
    values = {key: value for key, value in preset_values(preset).items() if key != "mtp_num_layers"}
    return GPTModel(ModelConfig(**{**values, **changes}))


def test_llama_layers_are_taken():
    assert fused_decode.computes_the_same_layers(_model("tiny-llama"))
    assert fused_decode.computes_the_same_layers(_model("tiny-llama", rotary_percent=0.5))
    assert not fused_decode.supported(_model("tiny-llama"))   # on the CPU: the model's own forward


@pytest.mark.parametrize("preset, changes", [
    ("tiny-gpt", {}),                                    # LayerNorm, GeLU, learned positions, biases
    ("tiny-moe", {}),
    ("tiny-deepseek", {}),                               # MLA
    ("tiny-llama", dict(qk_layernorm=True)),
    ("tiny-llama", dict(add_qkv_bias=True)),
    ("tiny-llama", dict(normalization="LayerNorm")),
    ("tiny-llama", dict(swiglu=False)),
], ids=["gpt", "moe", "mla", "qk-norm", "qkv-bias", "layernorm", "gelu"])
def test_other_layers_are_left_to_the_model(preset, changes):
    assert not fused_decode.computes_the_same_layers(_model(preset, **changes))

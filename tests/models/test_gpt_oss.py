"""GPT-OSS's blocks: sink and window attention on both paths, packed documents, config errors, sizes.

The oracles: transformers' eager GPT-OSS attention (scores, mask, the sink column, softmax, drop
it) for the attention kernels; the same model run on each document alone for packing; the
model card's parameter counts for the presets. transformers' whole model against tessera's
is tests/interop/test_hf_gpt_oss.py.
"""

import dataclasses

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss

from tessera.config import ConfigError, ModelConfig
from tessera.models.attention_sinks import allowed_keys, flex_sink_attention, sink_window_attention
from tessera.models.documents import Documents
from tessera.models.gpt import GPTModel, initialize_parameters
from tessera.models.presets import preset_values
from tessera.perf.flops import count_parameters, flops_per_token

CPU = torch.device("cpu")


def _qkv(batch=2, heads=4, groups=2, seq=16, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, n, seq, dim, generator=generator, dtype=torch.float64) for n in (heads, groups, groups))


def _hf_attention(q, k, v, sinks, window):
    """transformers' eager_attention_forward with its sliding-window causal mask, [b, heads, s, d]."""
    seq = q.shape[2]
    position = torch.arange(seq)
    keep = (position[None, :] <= position[:, None])
    if window is not None:
        keep &= position[None, :] > position[:, None] - (window + 1)   # HF's sliding_window = LEFT + 1
    mask = torch.zeros(seq, seq, dtype=q.dtype).masked_fill(~keep, float("-inf"))[None, None]
    module = type("Layer", (), {"num_key_value_groups": q.shape[1] // k.shape[1], "sinks": sinks,
                                "training": False})()
    out, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("learned_sinks", [False, True])
def test_both_attention_paths_match_transformers(window, learned_sinks):
    q, k, v = _qkv()
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) if learned_sinks \
        else torch.full((4,), -torch.inf, dtype=torch.float64)   # exp(-inf) = 0: HF without a sink
    expected = _hf_attention(q, k, v, sinks, window)
    ours = sinks if learned_sinks else None
    torch.testing.assert_close(sink_window_attention(q, k, v, ours, window, enable_gqa=True), expected)
    # FlexAttention, the GPU path, runs uncompiled (forward only) on a CPU.
    torch.testing.assert_close(flex_sink_attention(q, k, v, ours, window, None, enable_gqa=True), expected)


def test_documents_and_windows_mask_alike_on_both_paths():
    q, k, v = _qkv(seq=16)
    documents = Documents.from_cu_seqlens(torch.tensor([0, 5, 16, 20, 32]), 2, 16, backend="per_document", device=CPU)
    sinks = torch.randn(4, dtype=torch.float64)
    torch.testing.assert_close(flex_sink_attention(q, k, v, sinks, 3, documents, enable_gqa=True),
                               sink_window_attention(q, k, v, sinks, 3, documents, enable_gqa=True))
    allowed = allowed_keys(16, 3, documents, CPU)
    assert allowed[0, 6, 5] and not allowed[0, 5, 4] and not allowed[0, 10, 6]   # document start; window


def test_packed_documents_equal_each_document_alone():
    """tiny-gpt-oss (sinks, 7-token windows) over two packed rows equals the model run on each
    document by itself, positions restarting at each document."""
    config = ModelConfig(**preset_values("tiny-gpt-oss"))
    model = GPTModel(config).eval()
    initialize_parameters(model, seed=5)
    lengths = [[20, 3, 41], [64]]
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    bounds = torch.tensor([0, *[n for row in lengths for n in row]]).cumsum(0)
    documents = Documents.from_cu_seqlens(bounds, 2, 64, backend="per_document", device=CPU)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, documents=documents)
        for row, row_lengths in enumerate(lengths):
            start = 0
            for n in row_lengths:
                alone = model(ids[row:row + 1, start:start + n])
                torch.testing.assert_close(packed[row:row + 1, start:start + n], alone, rtol=1e-5, atol=1e-5)
                start += n


@pytest.mark.parametrize("fields, message", [
    ({"window_size": "8,2"}, "--window-size 8,2: attention is causal"),
    ({"window_size": "eight"}, "--window-size 'eight': give two ints"),
    ({"window_attn_skip_freq": "2"}, "--window-attn-skip-freq needs --window-size"),
    ({"window_size": "8,0", "window_attn_skip_freq": "[1,0,1]"}, "--window-attn-skip-freq '[1,0,1]' gives 3 layers"),
    ({"softmax_type": "learnable", "attention_dropout": 0.1}, "--attention-dropout must be 0"),
    ({"activation_func_clamp_value": 7.0}, "--activation-func-clamp-value needs a gated MLP"),
    ({"quick_geglu": True, "swiglu": True}, "--quick-geglu and --swiglu"),
])
def test_bad_settings_name_the_flags(fields, message):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, attention_dropout=0.0)
    with pytest.raises(ConfigError) as error:
        ModelConfig(**{**base, **fields})
    assert message in str(error.value)


def test_window_layers_follow_megatrons_rule():
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, window_size=(7, 0),
                attention_dropout=0.0)
    assert ModelConfig(**base, window_attn_skip_freq="2").window_layers() == [7, None, 7, None]
    assert ModelConfig(**base, window_attn_skip_freq="4").window_layers() == [7, 7, 7, None]
    assert ModelConfig(**base, window_attn_skip_freq="[0,1,1,0]").window_layers() == [None, 7, 7, None]
    assert ModelConfig(**base).window_layers() == [7] * 4


@pytest.mark.parametrize("name, total, active", [
    ("gpt-oss-20b", 20.91e9, 3.61e9),     # OpenAI's model card: active counts the unembedding, not the embedding
    ("gpt-oss-120b", 116.83e9, 5.13e9),
])
def test_preset_sizes_match_the_model_card(name, total, active):
    config = ModelConfig(**preset_values(name))
    count = count_parameters(config, vocab_size=config.vocab_size)
    assert count.total == pytest.approx(total, rel=2e-3)
    assert count.active - config.vocab_size * config.hidden_size == pytest.approx(active, rel=2e-3)


def test_windows_are_counted_as_megatron_counts_them():
    """As full causal attention: the FLOPs of the windowed preset equal those without windows."""
    config = ModelConfig(**preset_values("gpt-oss-20b"))
    full = dataclasses.replace(config, window_size=None, window_attn_skip_freq=None)
    assert flops_per_token(config) == flops_per_token(full)

"""The Mamba-2 mixer and its chunked scan: against an fp64 sequential recurrence, against
transformers' Mamba2Mixer with the same weights, and packed documents against separate runs."""

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ConfigError, ModelConfig
from tessera.config.hybrid import stage_ranges
from tessera.kernels.ssd import ssd_scan, ssd_step
from tessera.models.documents import Documents
from tessera.models.gpt import initialize_parameters
from tessera.models.mamba import MambaMixer
from tests.models.mixers import assert_packed_documents_equal_separate_runs, perturbed


def recurrence(x, dt, A, B, C, D, document_ids):
    """The SSM one token at a time (the definition), state reset where the document changes."""
    batch, seq, heads, _ = x.shape
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    y = torch.empty_like(x)
    for row in range(batch):
        state = x.new_zeros(heads, x.shape[3], B.shape[3])
        for t in range(seq):
            if t and document_ids[row, t] != document_ids[row, t - 1]:
                state = torch.zeros_like(state)
            decay = torch.exp(dt[row, t] * A)[:, None, None]
            state = decay * state + (dt[row, t, :, None] * x[row, t])[:, :, None] * B[row, t][:, None, :]
            y[row, t] = torch.einsum("hpn,hn->hp", state, C[row, t]) + D[:, None] * x[row, t]
    return y


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_chunked_scan_equals_the_fp64_recurrence(chunk_size):
    generator = torch.Generator().manual_seed(chunk_size)
    batch, seq, heads, head_dim, groups, state = 2, 23, 4, 3, 2, 5
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    x, B, C = rand(batch, seq, heads, head_dim), rand(batch, seq, groups, state), rand(batch, seq, groups, state)
    dt, A, D = F.softplus(rand(batch, seq, heads)), -3 * rand(heads).abs(), rand(heads)
    ids = torch.tensor([[0] * 5 + [1] * 13 + [2] * 5, [3] * 23])   # documents crossing chunk boundaries
    for document_ids in (ids, None):
        expected = recurrence(x, dt, A, B, C, D, ids if document_ids is not None else torch.zeros(batch, seq))
        got = ssd_scan(x, dt, A, B, C, D, document_ids=document_ids, chunk_size=chunk_size)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_scan_and_step_stay_fp32_under_autocast():
    """Under bf16 autocast (the trainer's) the scan and the decode step compute what they compute
    without it: their products are fp32, not autocast's bf16."""
    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    x, B, C = rand(2, 40, 4, 8), rand(2, 40, 2, 16), rand(2, 40, 2, 16)
    dt, A, D = F.softplus(rand(2, 40, 4)), -rand(4).abs(), rand(4)
    state = rand(2, 4, 8, 16)
    plain = ssd_scan(x, dt, A, B, C, D, chunk_size=16), ssd_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = ssd_scan(x, dt, A, B, C, D, chunk_size=16), ssd_step(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def _config(**extra) -> ModelConfig:
    extra.setdefault("hybrid_layer_pattern", None if "hybrid_override_pattern" in extra else "M")
    return ModelConfig(hidden_size=32, num_attention_heads=4, seq_length=32,
                       mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=4, vocab_size=64,
                       normalization="RMSNorm", disable_bias_linear=True, **extra)


def _mixer(config: ModelConfig, seed: int = 0) -> MambaMixer:
    torch.manual_seed(seed)
    return perturbed(MambaMixer(config, 0.02), seed)


def test_mixer_equals_transformers_mamba2_mixer():
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    config = _config()
    ours = _mixer(config)
    hf = Mamba2Mixer(Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=4, expand=2,
                                  chunk_size=8, layer_norm_epsilon=config.norm_epsilon, num_hidden_layers=1),
                     layer_idx=0)
    with torch.no_grad():
        for hf_name, name in (("in_proj.weight", "in_proj.weight"), ("conv1d.weight", "conv_weight"),
                              ("conv1d.bias", "conv_bias"), ("dt_bias", "dt_bias"), ("A_log", "A_log"), ("D", "D"),
                              ("norm.weight", "norm_weight"), ("out_proj.weight", "out_proj.weight")):
            hf.get_parameter(hf_name).copy_(ours.get_parameter(name))
    x = torch.randn(2, 19, 32, requires_grad=True)
    hf_x = x.detach().clone().requires_grad_()
    out, expected = ours(x), hf(hf_x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x.grad, hf_x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.A_log.grad, hf.A_log.grad, rtol=1e-4, atol=1e-5)


def test_packed_documents_equal_separate_runs():
    assert_packed_documents_equal_separate_runs(_mixer(_config(), seed=1), hidden_size=32)


def test_pattern_sets_layers_and_pipeline_segments():
    config = _config(hybrid_override_pattern="M*-|M-E|*-|MM", num_experts=4, num_layers=99)
    assert config.hybrid_layer_pattern == "M*-|M-E|*-|MM" and config.hybrid_override_pattern is None
    assert config.num_layers == 10 and config.moe_layers() == [False] * 5 + [True] + [False] * 4
    assert [list(r) for r in stage_ranges(config.hybrid_layer_pattern, 2)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        stage_ranges("M*|M-|MM", 2)


@pytest.mark.parametrize("pattern, message", [
    ("M*D-", "DeepSeek sparse attention"), ("M*x", "unknown symbol"), ("M*/M", "MTP"), ("M*E", "needs --num-experts"),
])
def test_bad_patterns_are_refused_in_one_line(pattern, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(hybrid_layer_pattern=pattern, hidden_size=32, num_attention_heads=4, seq_length=32)


def test_flops_follow_megatrons_hybrid_formula():
    """Megatron-LM's hybrid_flops (megatron/training/training.py), written out for the 8B hybrid."""
    from tessera.models.presets import preset_values
    from tessera.perf.flops import flops_per_iteration

    config = ModelConfig(**preset_values("mamba2-hybrid-8b"))
    batch, s, h, vocab = 3, config.seq_length, config.hidden_size, config.padded_vocab_size()
    tokens, squares = batch * s, batch * s * s
    heads, groups, kv = config.num_attention_heads, config.num_query_groups, config.kv_channels
    p = kv * heads / h
    attention = 4 * tokens * h * p * (h + h * groups / heads) + 2 * squares * h * p
    mlp = 4 * (config.ffn_hidden_size / h) * tokens * h * h
    d_in, state = 2 * h, config.mamba_state_dim
    mamba = (2 * tokens * h * (2 * d_in + 2 * config.mamba_num_groups * state + config.mamba_num_heads)
             + 7 * tokens * d_in * state + 2 * tokens * d_in * h)
    pattern = config.hybrid_layer_pattern
    expected = 3 * (pattern.count("*") * attention + pattern.count("-") * mlp + pattern.count("M") * mamba
                    + 2 * tokens * h * vocab)
    assert flops_per_iteration(config, batch) == pytest.approx(expected, rel=1e-12)


def test_parameter_count_is_the_models():
    from tessera.models.gpt import GPTModel
    from tessera.perf.flops import count_parameters

    config = _config(hybrid_layer_pattern="M*-E", num_experts=4, moe_shared_expert_intermediate_size=16,
                     group_query_attention=True, num_query_groups=2)
    assert count_parameters(config).total == sum(p.numel() for p in GPTModel(config).parameters())


def test_packed_documents_equal_separate_runs_through_the_model():
    """Attention and Mamba-2 layers together: packed samples give each document's logits alone."""
    from tessera.models.gpt import GPTModel

    config = _config(hybrid_layer_pattern="M*M-", hidden_dropout=0.0, attention_dropout=0.0,
                     position_embedding_type="none")
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    initialize_parameters(model, 3)
    ids = torch.randint(0, 64, (1, 24))
    documents = Documents.from_cu_seqlens(torch.tensor([0, 9, 24]), 1, 24, backend="per_document",
                                          device=torch.device("cpu"))
    with torch.no_grad():
        packed = model(ids, documents=documents)
        alone = torch.cat([model(ids[:, :9]), model(ids[:, 9:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)

"""The Gated DeltaNet mixer and its chunked delta rule: against an fp64 sequential recurrence (the
rule as arXiv 2412.06464 writes it), in pieces from the state between them (generation's prompt
chunks and one-token steps), against transformers' Qwen3NextGatedDeltaNet with the same weights,
packed documents against separate runs, and Megatron's FLOPs for G layers."""

import pytest
import torch
import torch.nn.functional as F

from tessera.config import ConfigError, ModelConfig
from tessera.kernels.delta_rule import gated_delta_rule, gated_delta_step
from tessera.models.gated_deltanet import GatedDeltaNet
from tests.models.mixers import assert_packed_documents_equal_separate_runs, perturbed


def recurrence(q, k, v, g, beta, document_ids):
    """One token at a time, S [K, V] per value head, reset where the document changes:
    S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T q  (q and k divided by
    sqrt(|x|^2 + 1e-6), flash-linear-attention's l2norm; q then by sqrt(K))."""
    batch, seq, heads, _ = v.shape
    q, k = ((t / (t.square().sum(-1, keepdim=True) + 1e-6).sqrt()).repeat_interleave(heads // t.shape[2], dim=2)
            for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    out = torch.empty_like(v)
    for row in range(batch):
        state = v.new_zeros(heads, k.shape[-1], v.shape[-1])
        for t in range(seq):
            if t and document_ids[row, t] != document_ids[row, t - 1]:
                state = torch.zeros_like(state)
            state = g[row, t].exp()[:, None, None] * state
            error = v[row, t] - torch.einsum("hkv,hk->hv", state, k[row, t])
            state = state + beta[row, t, :, None, None] * k[row, t, :, :, None] * error[:, None, :]
            out[row, t] = torch.einsum("hkv,hk->hv", state, q[row, t])
    return out


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_chunked_rule_equals_the_fp64_recurrence(chunk_size):
    generator = torch.Generator().manual_seed(chunk_size)
    batch, seq, key_heads, heads, key_dim, value_dim = 2, 23, 2, 4, 5, 3
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    q, k = rand(batch, seq, key_heads, key_dim), rand(batch, seq, key_heads, key_dim)
    v = rand(batch, seq, heads, value_dim)
    g, beta = -F.softplus(rand(batch, seq, heads)), torch.sigmoid(rand(batch, seq, heads))
    ids = torch.tensor([[0] * 5 + [1] * 13 + [2] * 5, [3] * 23])   # documents crossing chunk boundaries
    for document_ids in (ids, None):
        expected = recurrence(q, k, v, g, beta, ids if document_ids is not None else torch.zeros(batch, seq))
        got = gated_delta_rule(q, k, v, g, beta, document_ids=document_ids, chunk_size=chunk_size)
        torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-11)


def test_the_rule_in_pieces_from_the_state_between_them_equals_one_pass():
    """Chunks of 4 (the pieces cut inside chunks), fp64: 7 tokens, one recurrent step, then 9 tokens
    in which a second document starts, each from the state the piece before left, equal the 17
    tokens in one pass, outputs and final state (the second document's)."""
    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    q, k, v = rand(2, 17, 2, 5), rand(2, 17, 2, 5), rand(2, 17, 4, 3)
    g, beta = -F.softplus(rand(2, 17, 4)), torch.sigmoid(rand(2, 17, 4))
    ids = torch.tensor([[0] * 12 + [1] * 5] * 2)
    whole, final = gated_delta_rule(q, k, v, g, beta, document_ids=ids, chunk_size=4, return_final_states=True)
    state = torch.zeros(2, 4, 5, 3, dtype=torch.float64)
    first, state = gated_delta_rule(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], chunk_size=4,
                                    initial_states=state, return_final_states=True)
    step, state = gated_delta_step(state, q[:, 7], k[:, 7], v[:, 7], g[:, 7], beta[:, 7])
    last, state = gated_delta_rule(q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:], document_ids=ids[:, 8:],
                                   chunk_size=4, initial_states=state, return_final_states=True)
    torch.testing.assert_close(torch.cat([first, step[:, None], last], dim=1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, final, rtol=1e-12, atol=1e-12)


def test_rule_and_step_stay_fp32_under_autocast():
    """Under bf16 autocast (the trainer's) the chunked rule and the decode step compute what they
    compute without it: their products are fp32, not autocast's bf16."""
    generator = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    q, k, v = rand(2, 40, 2, 16), rand(2, 40, 2, 16), rand(2, 40, 4, 8)
    g, beta = -F.softplus(rand(2, 40, 4)), torch.sigmoid(rand(2, 40, 4))
    state = rand(2, 4, 16, 8)

    def both():
        return (gated_delta_rule(q, k, v, g, beta, chunk_size=16),
                gated_delta_step(state, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]))
    plain = both()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = both()
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def _config(**extra) -> ModelConfig:
    return ModelConfig(**{**dict(hidden_size=32, num_attention_heads=4, seq_length=32, vocab_size=64,
                                 normalization="RMSNorm", disable_bias_linear=True, hybrid_layer_pattern="G",
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                 linear_value_head_dim=6, linear_conv_kernel_dim=3, norm_epsilon=1e-6), **extra})


def _mixer(config: ModelConfig, seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    return perturbed(GatedDeltaNet(config, 0.02), seed)


def test_mixer_equals_transformers_qwen3_next_gated_deltanet():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from tessera.interop.hf_qwen3_next import mixer_from_hf, mixer_to_hf

    config = _config()
    ours = _mixer(config)
    hf = Qwen3NextGatedDeltaNet(Qwen3NextConfig(
        hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=3, rms_norm_eps=1e-6, num_hidden_layers=1), layer_idx=0)
    ours_state = {name: t.detach() for name, t in ours.state_dict().items()}
    hf.load_state_dict(mixer_to_hf(ours_state, "", "", config), strict=True)
    assert all(torch.equal(t, ours_state[name]) for name, t in mixer_from_hf(hf.state_dict(), "", "", config).items())
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


@pytest.mark.parametrize("extra, message", [
    (dict(linear_num_value_heads=3), "multiple of --linear-num-key-heads"),
    (dict(linear_key_head_dim=0), "--linear-key-head-dim"),
])
def test_bad_shapes_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message):
        _config(**extra)


def test_flops_follow_megatrons_hybrid_formula():
    """Megatron-LM's gdn_layer_flops in hybrid_flops (megatron/training/training.py), written out."""
    from tessera.perf.flops import flops_per_iteration

    config = _config(hybrid_layer_pattern="G*G-")
    batch, s, h, vocab = 3, config.seq_length, config.hidden_size, config.padded_vocab_size()
    tokens, squares = batch * s, batch * s * s
    heads, groups, kv = config.num_attention_heads, config.num_query_groups, config.kv_channels
    p = kv * heads / h
    attention = 4 * tokens * h * p * (h + h * groups / heads) + 2 * squares * h * p
    mlp = 4 * (config.ffn_hidden_size / h) * tokens * h * h
    qk, v = 2 * 8, 4 * 6
    gdn = 2 * tokens * (h * (2 * qk + 2 * v + 2 * 4) + 3 * (2 * qk + v) + 4 * 6 ** 2 * 4 + h * v)
    expected = 3 * (attention + mlp + 2 * gdn + 2 * tokens * h * vocab)
    assert flops_per_iteration(config, batch) == pytest.approx(expected, rel=1e-12)


def test_parameter_count_is_the_models():
    from tessera.models.gpt import GPTModel
    from tessera.perf.flops import count_parameters

    config = _config(hybrid_layer_pattern="G*-G")
    assert count_parameters(config).total == sum(p.numel() for p in GPTModel(config).parameters())

"""Memory model against hand-computed cases (Korthikanti et al. 2022) and a measured run."""

import pytest

from tessera.config import ModelConfig
from tessera.perf.layout import Layout
from tessera.perf.memory import GIB, chunks_in_flight, estimate_memory, layer_activation_bytes, stage_parameters

S, B, H, A, L = 2048, 2, 1024, 16, 8


def gpt(dropout=0.1, **extra):
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=1000,
                       hidden_dropout=dropout, attention_dropout=dropout, **extra)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_layer_activations_match_the_paper_without_sequence_parallel(tp):
    # Paper, eq. 2 / table 2: s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes per layer.
    expected = S * B * H * (10 + 24 / tp + 5 * A * S / (H * tp))
    got = layer_activation_bytes(gpt(), Layout(tp=tp, micro_batch_size=B), S, fused_attention=False)
    assert got == pytest.approx(expected)


def test_layer_activations_with_sequence_parallel_and_selective_recompute():
    tp = 4
    sp = Layout(tp=tp, micro_batch_size=B, sequence_parallel=True)
    assert layer_activation_bytes(gpt(), sp, S, fused_attention=False) == \
        pytest.approx(S * B * H * (34 + 5 * A * S / H) / tp)
    selective = Layout(tp=tp, micro_batch_size=B, sequence_parallel=True, recompute="selective")
    assert layer_activation_bytes(gpt(), selective, S) == pytest.approx(S * B * H * 34 / tp)
    full = Layout(tp=tp, micro_batch_size=B, sequence_parallel=True, recompute="full")
    assert layer_activation_bytes(gpt(), full, S) == pytest.approx(2 * S * B * H / tp)


def test_fused_attention_without_dropout_keeps_no_scores():
    # No masks (34 - 2 = 32 sbh) and only the fp32 log-sum-exp per head and token.
    got = layer_activation_bytes(gpt(dropout=0.0), Layout(micro_batch_size=B), S)
    assert got == pytest.approx(32 * S * B * H + 4 * S * B * A)


def test_micro_batches_in_flight_under_1f1b_and_interleaving():
    assert chunks_in_flight(Layout(pp=4), 8, stage=0) == 4
    assert chunks_in_flight(Layout(pp=4), 8, stage=3) == 1
    assert chunks_in_flight(Layout(pp=4), 2, stage=0) == 2
    # Interleaved, p=4, v=2: 11 chunks of L/8 layers = L * (1 + (p-1)/(p*v)).
    assert chunks_in_flight(Layout(pp=4, virtual_stages=2), 8, stage=0) == 11


def test_parameters_and_18_bytes_each_on_one_gpu():
    model = gpt()
    # Per layer: QKV and projection 4h^2 + 4h, MLP 8h^2 + 5h, two LayerNorms 4h.
    per_layer = 12 * H * H + 13 * H
    total = L * per_layer + 2 * H + 1024 * H + S * H   # final norm, padded vocab 1024, positions
    assert stage_parameters(model, Layout(), 1024, "only") == total
    memory = estimate_memory(model, Layout(micro_batch_size=B), 4, S)
    assert memory.weights + memory.gradients + memory.optimizer == pytest.approx(18 * total)


def test_distributed_optimizer_shards_only_the_optimizer_state():
    model = gpt()
    one = estimate_memory(model, Layout(dp=1), 8, S)
    four = estimate_memory(model, Layout(dp=4, distributed_optimizer=True), 8, S)
    assert four.optimizer == pytest.approx(one.optimizer / 4)
    assert four.weights == one.weights and four.gradients == one.gradients
    fsdp = estimate_memory(model, Layout(dp=4, fsdp=True), 8, S)
    assert fsdp.weights == pytest.approx(one.weights / 4)


def test_megatron_core_on_one_h200_matches_the_measured_peak():
    # shared/anchors: Megatron-Core 0.16 config A (GPT 1.3B, mbs 8, seq 2048, no dropout,
    # SDPA) peaked at 50.88 GiB on one GPU and 43.53 GiB per GPU with DP=2 and the
    # distributed optimizer.
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                        vocab_size=50257, hidden_dropout=0.0, attention_dropout=0.0)
    one = estimate_memory(model, Layout(micro_batch_size=8), 8, 2048).total / GIB
    two = estimate_memory(model, Layout(dp=2, micro_batch_size=8, distributed_optimizer=True), 16, 2048).total / GIB
    assert one == pytest.approx(50.88, rel=0.05)
    assert two == pytest.approx(43.53, rel=0.05)


def test_compiled_blocks_do_not_save_the_activated_mlp_output():
    """torch.compile recomputes GeLU(fc1 output) in backward: 2 bytes x s x b x ffn per layer less."""
    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=512, vocab_size=1000,
                        hidden_dropout=0.0, attention_dropout=0.0)
    eager = estimate_memory(model, Layout(micro_batch_size=2), 2, 512)
    compiled = estimate_memory(model, Layout(micro_batch_size=2, compiled=True), 2, 512)
    assert eager.activations - compiled.activations == pytest.approx(4 * 2 * 512 * 2 * 1024)

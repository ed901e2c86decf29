"""Memory model against hand-computed cases (Korthikanti et al. 2022) and a measured run."""

import functools

import pytest
import torch

from tessera.config import ModelConfig
from tessera.perf.layout import Layout
from tessera.perf.memory import GIB, chunks_in_flight, estimate_memory, layer_activation_bytes, stage_parameters
from tests.perf import saved_tensors
from tests.perf.saved_tensors import bytes_saved_for_backward

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
    assert stage_parameters(model, Layout(), 1024, 0).total == total
    memory = estimate_memory(model, Layout(micro_batch_size=B), 4, S)
    assert memory.weights + memory.gradients + memory.optimizer == pytest.approx(18 * total)


def test_each_pipeline_rank_is_counted_with_its_own_layers():
    # 8 layers over 4 ranks as 1 + 3 + 3 + 1: rank 0 holds 4 micro-batches of 1 layer, rank 1
    # holds 3 of 3 layers and is the fullest; an even split would make rank 0 the fullest.
    model, layout = gpt(), Layout(pp=4, micro_batch_size=B, first_stage_layers=1, last_stage_layers=1)
    per_layer = 12 * H * H + 13 * H
    assert stage_parameters(model, layout, 1024, 1).total == 3 * per_layer
    assert stage_parameters(model, layout, 1024, 3).total == per_layer + 2 * H + 1024 * H  # final norm, output layer
    memory = estimate_memory(model, layout, 8, S)
    assert memory.stage == "pipeline rank 1 of 4"
    assert memory.activations == pytest.approx(3 * 3 * layer_activation_bytes(model, layout, S))
    even = estimate_memory(model, Layout(pp=4, micro_batch_size=B), 8, S)
    assert even.stage == "pipeline rank 0 of 4"


def test_distributed_optimizer_shards_only_the_optimizer_state():
    model = gpt()
    one = estimate_memory(model, Layout(dp=1), 8, S)
    four = estimate_memory(model, Layout(dp=4, distributed_optimizer=True), 8, S)
    assert four.optimizer == pytest.approx(one.optimizer / 4)
    assert four.weights == one.weights and four.gradients == one.gradients
    fsdp = estimate_memory(model, Layout(dp=4, fsdp=True), 8, S)
    assert fsdp.weights == pytest.approx(one.weights / 4)


def test_tessera_distributed_optimizer_keeps_no_gradient_buffer_with_nothing_to_reduce():
    """One GPU and one micro-batch: autograd's bf16 gradients are the main gradients, made as the
    backward frees activations, so none lives at the peak; two micro-batches or two replicas need the
    fp32 buffer (tessera.training.optimizer.build_optimizer's `stored`)."""
    model, tessera = gpt(), dict(framework="tessera", distributed_optimizer=True, micro_batch_size=B)
    parameters = stage_parameters(model, Layout(), 1024, 0).total   # vocab 1000 padded to 1024
    alone = estimate_memory(model, Layout(**tessera), B, S)
    accumulating = estimate_memory(model, Layout(**tessera), 2 * B, S)
    replicated = estimate_memory(model, Layout(dp=2, **tessera), 2 * B, S)
    assert alone.gradients == 0
    assert accumulating.gradients == replicated.gradients == pytest.approx(4 * parameters)
    assert estimate_memory(model, Layout(distributed_optimizer=True, micro_batch_size=B), B, S).gradients > 0   # Megatron


def test_megatron_core_on_one_h200_matches_the_measured_peak():
    # Megatron-Core 0.16, measured: config A (GPT 1.3B, mbs 8, seq 2048, no dropout,
    # SDPA) peaked at 50.88 GiB on one GPU and 43.53 GiB per GPU with DP=2 and the
    # distributed optimizer.
    model = ModelConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                        vocab_size=50257, hidden_dropout=0.0, attention_dropout=0.0)
    one = estimate_memory(model, Layout(micro_batch_size=8), 8, 2048).total / GIB
    two = estimate_memory(model, Layout(dp=2, micro_batch_size=8, distributed_optimizer=True), 16, 2048).total / GIB
    assert one == pytest.approx(50.88, rel=0.05)
    assert two == pytest.approx(43.53, rel=0.05)


@pytest.mark.parametrize("preset,compiled", [("gpt3-1.3b", False), ("gpt3-1.3b", True), ("llama-1.2b", True)])
def test_tessera_layer_activations_are_what_autograd_saves(preset, compiled):
    """The oracle is autograd (tests/perf/saved_tensors.py). Eager RMSNorm and SwiGLU save more than
    this (intermediates the compiled kernels fuse); tessera compiles on GPUs, so that case is not modelled."""
    saved, model = saved_tensors.saved_block_bytes(preset, compiled=compiled)
    layout = Layout(micro_batch_size=saved_tensors.B, compiled=compiled, framework="tessera")
    assert saved == pytest.approx(layer_activation_bytes(model, layout, saved_tensors.S), rel=0.005)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_tensor_parallel_layer_activations_are_what_autograd_saves(sequence_parallel):
    """The same oracle on each of two TP ranks (gloo), a compiled LLaMA block at TP=2: without SP
    the QKV and fc1 inputs are whole on every rank, under SP they are kept all-gathered, and the
    attention projection's output (which the compiled block keeps) is a sequence shard."""
    from tests.dist.launcher import run_distributed

    saved = run_distributed(functools.partial(saved_tensors.saved_block_bytes, compiled=True, tp=2,
                                              sequence_parallel=sequence_parallel), 2, "llama-1.2b")
    model = saved_tensors.saved_block_bytes("llama-1.2b", compiled=True)[1]
    layout = Layout(tp=2, micro_batch_size=saved_tensors.B, compiled=True, framework="tessera",
                    sequence_parallel=sequence_parallel)
    expected = layer_activation_bytes(model, layout, saved_tensors.S)
    for rank_saved, _ in saved:
        assert rank_saved == pytest.approx(expected, rel=0.005)


def mixtral():
    from tessera.models.presets import preset_values

    return ModelConfig(**preset_values("mixtral-8x7b"))


def test_expert_parallelism_divides_the_experts_and_the_optimizer_shards_them_over_their_replicas():
    # Mixtral 8x7B, PP4: 8 layers per rank, each with 8 experts of 3 x 4096 x 14336 weights.
    model, experts = mixtral(), 8 * 8 * 3 * 4096 * 14336
    for ep in (1, 2, 4, 8):
        layout = Layout(pp=4, dp=16, ep=ep, distributed_optimizer=True)
        assert stage_parameters(model, layout, 32000, 1).experts == experts / ep
        # bf16 weights and fp32 gradients of this rank's experts; master + Adam over EDP = 16 / EP.
        memory = estimate_memory(model, layout, 64, 4096)
        assert memory.expert_state == pytest.approx(6 * experts / ep + 12 * experts / ep / (16 // ep))
    plain = [estimate_memory(model, Layout(pp=4, dp=16, ep=ep), 64, 4096).expert_state for ep in (1, 8)]
    assert plain[0] == pytest.approx(8 * plain[1]) and plain[1] == pytest.approx(18 * experts / 8)
    # Expert TP slices every expert too.
    etp = Layout(tp=2, pp=4, dp=8, ep=4, etp=2, sequence_parallel=True)
    assert stage_parameters(model, etp, 32000, 1).experts == experts / 8


def test_a_dense_first_layer_stays_on_its_pipeline_rank():
    # tiny-moe: layer 0 dense, layers 1-3 MoE; two ranks hold layers 0-1 and 2-3.
    from tessera.models.presets import preset_values
    from tessera.perf.flops import layer_parameters

    model = ModelConfig(**preset_values("tiny-moe"))
    dense, moe = layer_parameters(model)[:2]
    assert dense.experts == 0 and moe.experts == 4 * 3 * 64 * 48
    layout = Layout(pp=2, dp=2, ep=2)
    first, last = (stage_parameters(model, layout, 256, rank) for rank in (0, 1))
    assert first.experts == moe.experts / 2 and last.experts == moe.experts
    assert first.dense == dense.dense + moe.dense + 256 * 64
    assert last.dense == 2 * moe.dense + 64 + 256 * 64   # final norm, the tied output layer's copy


def test_moe_layer_activations_are_what_autograd_saves():
    """As test_tessera_layer_activations_are_what_autograd_saves, for a compiled tessera MoE block:
    attention, a shared expert, 4 experts (top-2, grouped GEMMs, fp32 router) on one process."""
    from tessera.cli.args import parse_run_config
    from tessera.models.gpt import GPTModel

    b, s, h = 2, 96, 320
    config, _ = parse_run_config(["--model", "tiny-moe", "--num-layers", "1", "--moe-layer-freq", "1",
                                  "--hidden-size", str(h), "--num-attention-heads", "4", "--num-query-groups", "4",
                                  "--moe-ffn-hidden-size", "448", "--moe-shared-expert-intermediate-size", "256",
                                  "--moe-grouped-gemm", "--moe-router-dtype", "fp32", "--seq-length", str(s),
                                  "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-3",
                                  "--train-iters", "1", "--mock-data"], "test")
    model = GPTModel(config.model)
    block = model.layers[0]
    block.compile()
    saved = bytes_saved_for_backward(block, torch.randn(b, s, h, requires_grad=True), model.rotary(s, None))
    layout = Layout(micro_batch_size=b, compiled=True, framework="tessera")
    assert saved == pytest.approx(layer_activation_bytes(config.model, layout, s, moe=True), rel=0.02)

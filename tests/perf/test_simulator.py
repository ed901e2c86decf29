"""Time model against hand-computed cases: collectives, GEMMs, an ideal GPU, the pipeline, DP."""

import pytest

from tessera.config import ModelConfig
from tessera.perf.cluster import CLUSTERS, Cluster, Link
from tessera.perf.hardware import GPU
from tessera.perf.kernels import PROVISIONAL, KernelCurves
from tessera.perf.layout import Layout
from tessera.perf.simulator import predict

PEAK = 1000e12
# A GPU that runs every GEMM and attention kernel at its peak and has endless HBM and
# links: the step time must then be the FLOPs really done divided by the peak.
IDEAL_GPU = GPU("ideal", {"bf16": PEAK / 1e12}, 1000, 1e9)
IDEAL_CURVES = KernelCurves("ideal", sms=1, gemm_max=1.0, gemm_k0=0.0, attn_max=1.0, attn_s0=0.0,
                            hbm_efficiency=1.0)
FAST = Link("endless", 1e12, 1.0, 0.0, 0.0)
IDEAL = Cluster("ideal", IDEAL_GPU, 8, FAST, FAST)

L, H, A, S, V = 4, 1024, 8, 2048, 4096


def gpt(**extra):
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=V,
                       hidden_dropout=0.0, attention_dropout=0.0, **extra)


def real_flops_per_token():
    # GEMMs: 6 FLOPs per weight per token (QKV 3h^2, projection h^2, MLP 8h^2) and the logits;
    # causal attention: forward 2*s*h per token (half of QK^T and AV), backward 2.5x forward.
    linear = 6 * (L * 12 * H * H + H * V)
    attention = L * 3.5 * 2 * S * H
    return linear + attention


def test_ring_collectives_by_hand():
    dgx = CLUSTERS["dgx-h100"]
    size = 1e9
    inside = dgx.all_gather(size, 8, 8)
    assert inside == pytest.approx(7 * 3e-6 + 7 / 8 * size / (450e9 * 0.8))
    one_per_node = dgx.reduce_scatter(size, 16, 1)
    assert one_per_node == pytest.approx(15 * 8e-6 + 15 / 16 * size / (50e9 * 0.8))
    # Eight ranks per node share eight NICs: 8 x 40 GB/s, below NVLink's 360 GB/s.
    assert dgx.group_bandwidth(64, 8) == pytest.approx(8 * 50e9 * 0.8)
    assert dgx.all_reduce(size, 64, 8) == pytest.approx(2 * dgx.all_gather(size, 64, 8))


def test_gemm_time_by_hand():
    curves = KernelCurves("test", sms=132, gemm_max=0.8, gemm_k0=128, attn_max=0.5, attn_s0=1024,
                          hbm_efficiency=0.9)
    # 1024 x 2048 output = 8 x 8 tiles of 128 x 256 = 64 tiles on 132 SMs: one wave, 64/132 busy.
    efficiency = 0.8 * (64 / 132) * 4096 / (4096 + 128)
    assert curves.gemm_efficiency(1024, 2048, 4096) == pytest.approx(efficiency)
    assert curves.gemm_time(1024, 2048, 4096, PEAK, 1e15) == pytest.approx(2 * 1024 * 2048 * 4096 / (PEAK * efficiency))


def test_one_ideal_gpu_takes_the_real_flops_over_peak():
    batch = 4
    prediction = predict(gpt(), Layout(micro_batch_size=2), IDEAL, IDEAL_CURVES, batch, S)
    expected = batch * S * real_flops_per_token() / PEAK
    assert prediction.step_time == pytest.approx(expected, rel=1e-6)
    # MFU counts causal attention as the kernels do, but not the recomputed scores.
    counted = batch * S * 6 * (L * 12 * H * H + H * V + L * S * H)
    assert prediction.mfu == pytest.approx(counted / PEAK / expected)


def layer_seconds(layers):
    """One micro-batch (one sequence) through `layers` layers on the ideal GPU."""
    return layers * S * (6 * 12 * H * H + 3.5 * 2 * S * H) / PEAK


def test_pipeline_bubble_by_hand():
    # The slowest (last) stage runs m micro-batches; the fill and the drain add every other
    # stage's micro-batch time once, divided over v chunks.
    m, p = 8, 4
    prediction = predict(gpt(), Layout(pp=p, micro_batch_size=1), IDEAL, IDEAL_CURVES, m, S)
    stage = layer_seconds(L / p)
    last_stage = stage + S * 6 * H * V / PEAK     # the last stage also computes the logits
    assert prediction.step_time == pytest.approx(m * last_stage + (p - 1) * stage, rel=1e-6)
    interleaved = predict(gpt(), Layout(pp=2, virtual_stages=2), IDEAL, IDEAL_CURVES, m, S)
    assert interleaved.breakdown["pp_bubble"] == pytest.approx((2 - 1) / 2 * layer_seconds(L / 2))


def test_uneven_pipeline_by_hand():
    # 4 layers over 2 stages as 3 + 1: the first stage is the slowest now.
    m = 8
    layout = Layout(pp=2, first_stage_layers=3, last_stage_layers=1)
    prediction = predict(gpt(), layout, IDEAL, IDEAL_CURVES, m, S)
    first, last = layer_seconds(3), layer_seconds(1) + S * 6 * H * V / PEAK
    assert first > last
    assert prediction.step_time == pytest.approx(m * first + last, rel=1e-6)


def test_exposed_data_parallel_communication_by_hand():
    dgx = CLUSTERS["dgx-h100"]
    model = gpt()
    layout = Layout(dp=16, distributed_optimizer=True, overlap_grad_reduce=False, overlap_param_gather=False)
    prediction = predict(model, layout, dgx, PROVISIONAL, 16, S)
    params = L * (12 * H * H + 13 * H) + 2 * H + V * H + S * H
    # DP 16 over two nodes, eight ranks each: fp32 gradients reduce-scattered, bf16 weights gathered.
    expected = dgx.reduce_scatter(4 * params, 16, 8) + dgx.all_gather(2 * params, 16, 8)
    assert prediction.breakdown["dp_comm"] == pytest.approx(expected)
    overlapped = predict(model, Layout(dp=16, distributed_optimizer=True), dgx, PROVISIONAL, 16, S)
    assert overlapped.breakdown["dp_comm"] < expected


def test_an_overlapped_reduction_never_costs_more_than_an_exposed_one():
    # A model smaller than one gradient bucket (40M parameters): the overlap has nothing to hide
    # behind the backward, the whole reduction is the last bucket.
    small = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=S, vocab_size=V,
                        hidden_dropout=0.0, attention_dropout=0.0)
    exposed, overlapped = (predict(small, Layout(dp=16, overlap_grad_reduce=overlap), CLUSTERS["dgx-h100"],
                                   PROVISIONAL, 16, S).breakdown["dp_comm"] for overlap in (False, True))
    assert overlapped == pytest.approx(exposed)


def test_tensor_parallel_costs_communication_and_sequence_parallel_saves_memory():
    dgx = CLUSTERS["dgx-h100"]
    # Wide enough that each GEMM outlasts the collective beside it.
    model = ModelConfig(num_layers=2, hidden_size=8192, num_attention_heads=64, seq_length=S, vocab_size=V)
    tp = predict(model, Layout(tp=8), dgx, PROVISIONAL, 8, S)
    sp = predict(model, Layout(tp=8, sequence_parallel=True, tp_comm_overlap=True), dgx, PROVISIONAL, 8, S)
    assert tp.breakdown["tp_comm"] > sp.breakdown["tp_comm"] > 0
    assert sp.memory.activations < tp.memory.activations


def test_tessera_tp_comm_overlap_hides_the_collectives_and_keeps_only_shards():
    """tessera at TP=8 + SP: without --tp-comm-overlap every collective is exposed and the
    all-gathered QKV and fc1 inputs are saved; with it (tessera.parallel.tp_overlap) each runs
    under its GEMM, the backward re-gathers the input, and only the shards are saved."""
    dgx = CLUSTERS["dgx-h100"]
    model = ModelConfig(num_layers=2, hidden_size=8192, num_attention_heads=64, seq_length=S, vocab_size=V)
    plain, overlapped = (predict(model, Layout(tp=8, sequence_parallel=True, tp_comm_overlap=overlap,
                                               framework="tessera"), dgx, PROVISIONAL, 8, S)
                         for overlap in (False, True))
    assert 0 < overlapped.breakdown["tp_comm"] < plain.breakdown["tp_comm"]
    assert overlapped.step_time < plain.step_time
    # QKV's and fc1's inputs: 2 bytes x s x b x h each per layer, 1/8 of them kept instead of all; but
    # the overlapped fc2 has GEMMs of its own, so it keeps the activation that the fused one does not
    gathered = 2 * (2 * S * 1 * model.hidden_size) * model.num_layers
    activation = 2 * S * 1 * model.ffn_hidden_size / 8 * model.num_layers
    assert plain.memory.activations - overlapped.memory.activations == \
        pytest.approx(gathered * (1 - 1 / 8) - activation, rel=1e-6)


def test_tessera_pipeline_transfers_are_exposed_unless_overlapped():
    """tessera's runner waits for every batch of transfers: 2 v m sends beyond the fill and drain's
    2 (p v - 1), unless --overlap-p2p-communication keeps them in flight (Megatron's way)."""
    dgx = CLUSTERS["dgx-h100"]
    layouts = [Layout(pp=2, virtual_stages=2, framework="tessera", overlap_p2p_communication=overlap)
               for overlap in (False, True)]
    waiting, overlapped = (predict(gpt(), layout, dgx, PROVISIONAL, 8, S) for layout in layouts)
    micro_batches = 8
    send = dgx.send(1 * S * H * 2, False)
    assert overlapped.breakdown["pp_p2p"] == pytest.approx(2 * (2 * 2 - 1) * send)
    assert waiting.breakdown["pp_p2p"] == pytest.approx((2 * (2 * 2 - 1) + 2 * 2 * micro_batches) * send)
    assert "--overlap-p2p-communication" in layouts[1].flags() and "--overlap-p2p-communication" not in \
        layouts[0].flags()


def test_full_recompute_costs_one_more_forward():
    plain = predict(gpt(), Layout(), IDEAL, IDEAL_CURVES, 2, S)
    full = predict(gpt(), Layout(recompute="full"), IDEAL, IDEAL_CURVES, 2, S)
    layers_forward = 2 * S * (2 * L * 12 * H * H + L * 2 * S * H) / PEAK
    assert full.step_time - plain.step_time == pytest.approx(layers_forward, rel=1e-6)
    assert full.mfu < plain.mfu


def moe_gpt(experts=4):
    # GeLU experts (2 GEMMs of h x f each), top-2, bf16 router, no biases.
    return gpt(disable_bias_linear=True, num_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=2048,
               moe_grouped_gemm=True)


def test_one_ideal_gpu_runs_a_moe_model_at_its_real_flops():
    # Per token and MoE layer: k = 2 experts of 2 x h x f, and the router's h x E GEMM, which the
    # time counts and Megatron's FLOPs (for MFU) do not.
    batch, k, f, experts = 4, 2, 2048, 4
    prediction = predict(moe_gpt(), Layout(micro_batch_size=2), IDEAL, IDEAL_CURVES, batch, S)
    attention_and_logits = 6 * (L * 4 * H * H + H * V) + L * 3.5 * 2 * S * H
    experts_and_router = 6 * L * (k * 2 * H * f + H * experts)
    expected = batch * S * (attention_and_logits + experts_and_router) / PEAK
    assert prediction.step_time == pytest.approx(expected, rel=1e-6)
    counted = batch * S * (6 * (L * (4 * H * H + k * 2 * H * f) + H * V) + 6 * L * S * H)
    assert prediction.model_flops == pytest.approx(counted)


def test_all_to_all_by_hand():
    dgx = CLUSTERS["dgx-h100"]
    size = 1e9
    # Eight ranks of a node: each sends 7/8 of its bytes over NVLink.
    assert dgx.all_to_all(size, 8, 8) == pytest.approx(7 * 3e-6 + 7 / 8 * size / (450e9 * 0.8))
    # Two nodes: half of the bytes leave the node through each GPU's own NIC, the slower part.
    assert dgx.all_to_all(size, 16, 8) == pytest.approx((7 * 3 + 8) * 1e-6 + 8 / 16 * size / (50e9 * 0.8))
    assert dgx.ranks_per_node(8, stride=2) == 4 and dgx.ranks_per_node(4, stride=16) == 1


def test_token_dispatch_runs_on_nvlink_inside_a_node_and_on_the_network_beyond():
    from tessera.perf.kernels import load_curves
    from tessera.perf.moe import dispatch_seconds
    from tessera.perf.simulator import StepModel

    dgx, model = CLUSTERS["dgx-h100"], moe_gpt(experts=8)
    steps, tokens, h, k = StepModel(model, dgx, load_curves(gpu_name="H100"), S), 2048.0, H, 2
    inside = Layout(dp=8, ep=8, moe_dispatcher="alltoall")
    rows = tokens * k
    a2a = 2 * dgx.all_to_all(rows * 2 * h, 8, 8) + dgx.all_to_all(rows * 4, 8, 8)
    assert dispatch_seconds(steps, inside, tokens) == pytest.approx((a2a + dgx.all_gather(8 * 8 * 8, 8, 8), a2a))
    # Expert TP 2 first gathers over its pair, then the 8 EP ranks (stride 2) span two nodes.
    spread = Layout(tp=2, dp=8, ep=8, sequence_parallel=True, moe_dispatcher="alltoall")
    rows = 2 * tokens * k
    etp = dgx.all_gather(2 * tokens * (2 * h + 20 * k), 2, 2) + dgx.reduce_scatter(2 * tokens * 2 * h, 2, 2)
    a2a = 2 * dgx.all_to_all(rows * 2 * h, 8, 4) + dgx.all_to_all(rows * 4, 8, 4)
    assert dispatch_seconds(steps, spread, tokens)[1] == pytest.approx(etp + a2a)
    # allgather: the whole EP x ETP group's tokens, then a reduce-scatter of the outputs.
    gathered = Layout(dp=8, ep=8)
    both = dgx.all_gather(8 * tokens * (2 * h + 20 * k), 8, 8) + dgx.reduce_scatter(8 * tokens * 2 * h, 8, 8)
    assert dispatch_seconds(steps, gathered, tokens) == pytest.approx((both, both))


def test_expert_gradients_are_reduced_over_expert_data_parallelism():
    from tessera.perf.memory import stage_parameters

    dgx, model = CLUSTERS["dgx-h100"], moe_gpt(experts=8)
    layout = Layout(dp=16, ep=8, distributed_optimizer=True, overlap_grad_reduce=False, overlap_param_gather=False)
    params = stage_parameters(model, layout, V, 0)
    assert params.experts == L * 8 * 2 * H * 2048 / 8
    # Dense parameters over DP 16 (two nodes); each expert over its 2 replicas, 8 ranks apart (one per node).
    expected = dgx.reduce_scatter(4 * params.dense, 16, 8) + dgx.reduce_scatter(4 * params.experts, 2, 1) + \
        dgx.all_gather(2 * params.dense, 16, 8) + dgx.all_gather(2 * params.experts, 2, 1)
    assert predict(model, layout, dgx, PROVISIONAL, 16, S).breakdown["dp_comm"] == pytest.approx(expected)

"""Layout search: infeasible layouts rejected, textbook cases get the known-good family, any
layer count gets pipelines, the overlaps are searched, and every candidate is one tessera train runs."""

import itertools

import pytest

from tessera.cli.args import parse_run_config
from tessera.config import ConfigError, ModelConfig
from tessera.models.presets import preset_values
from tessera.parallel.pipeline_schedules import stage_layer_ranges
from tessera.perf.cluster import CLUSTERS
from tessera.perf.kernels import load_curves
from tessera.perf.layout import Layout, check_layout
from tessera.perf.memory import usable_bytes
from tessera.perf.pipeline_balance import balance_pipeline
from tessera.perf.search import SearchSpace, candidates, search, step_time_bound, uneven_split
from tessera.perf.simulator import StepModel, predict

DGX = CLUSTERS["dgx-h100"]
CURVES = load_curves(gpu_name="H100")


def preset(name, seq):
    return ModelConfig(**{**preset_values(name), "seq_length": seq})


@pytest.mark.parametrize("layout, flag", [
    (Layout(tp=3), "--num-attention-heads"),
    (Layout(pp=7), "--num-layers"),
    (Layout(dp=3), "--global-batch-size"),
    (Layout(pp=2, virtual_stages=2, dp=1), "interleaved"),
    (Layout(ep=2), "--expert-model-parallel-size"),
])
def test_unrunnable_layouts_are_rejected_naming_the_flag(layout, flag):
    model = preset("llama3-8b", 4096)   # 32 layers, 32 heads, 8 query groups
    with pytest.raises(ConfigError, match=flag):
        check_layout(model, layout, global_batch_size=3 if layout.virtual_stages > 1 else 8, seq_length=4096)


def test_a_layout_that_cannot_fit_is_never_chosen():
    model = preset("llama3-70b", 4096)
    alone = predict(model, Layout(), DGX, CURVES, 8, 4096)
    assert alone.memory.total > usable_bytes(80)           # 70B on one GPU: over 1 TB
    assert search(model, 1, DGX, CURVES, 8, 4096) == []
    for prediction in search(model, 16, DGX, CURVES, 64, 4096):
        assert prediction.memory.total <= usable_bytes(80)


def test_70b_on_64_gpus_keeps_tensor_parallelism_inside_a_node():
    model = preset("llama3-70b", 4096)
    space = SearchSpace(tp=(1, 2, 4, 8, 16, 32))    # let it try TP across nodes too
    best = search(model, 64, DGX, CURVES, 512, 4096, space)
    assert best, "some layout must fit"
    for prediction in best:
        layout = prediction.layout
        assert 2 <= layout.tp <= 8                     # TP over NVLink only
        assert layout.tp * layout.pp >= 8              # 70B needs model parallelism on 80 GB
        assert layout.distributed_optimizer and layout.sequence_parallel


def test_8b_on_8_gpus_needs_no_pipeline():
    best = search(preset("llama3-8b", 4096), 8, DGX, CURVES, 64, 4096, top=1)[0]
    assert best.layout.pp == 1 and best.layout.tp <= 2


def test_175b_on_1024_gpus_uses_tp_within_a_node_and_a_pipeline():
    best = search(preset("gpt3-175b", 2048), 1024, DGX, CURVES, 1536, 2048, top=1)[0]
    assert best.layout.tp in (4, 8) and best.layout.pp >= 4


def test_long_sequences_bring_context_parallelism_into_play():
    model = preset("llama3-8b", 32768)
    assert any(layout.cp > 1 for layout in candidates(model, 16, 8, 16, 32768))
    assert all(layout.cp == 1 for layout in candidates(preset("llama3-8b", 4096), 16, 8, 16, 4096))


@pytest.mark.parametrize("layout, flag", [
    (Layout(dp=6, ep=3), "--num-experts"),                                  # 8 experts over 3 ranks
    (Layout(dp=4, ep=8), "--expert-model-parallel-size"),                   # EP 8 cannot fold into 4 ranks
    (Layout(tp=2, dp=4, ep=8, sequence_parallel=True), "--expert-model-parallel-size"),  # x ETP 2: 16 > 8
    (Layout(dp=6, ep=2, etp=3), "--moe-ffn-hidden-size"),                  # 14336 / 3
    (Layout(tp=2, dp=4, ep=4), "--sequence-parallel"),
    (Layout(dp=8, ep=2, moe_dispatcher="flex"), "--moe-token-dispatcher-type"),
])
def test_unrunnable_moe_layouts_are_rejected_naming_the_flag(layout, flag):
    with pytest.raises(ConfigError, match=flag):
        check_layout(preset("mixtral-8x7b", 4096), layout, global_batch_size=48, seq_length=4096)


def test_the_search_folds_expert_parallelism_into_the_stage():
    model = preset("mixtral-8x7b", 4096)
    layouts = candidates(model, 16, 8, 64, 4096, SearchSpace(pp=(1,), micro_batch_size=(1,)))
    assert {layout.ep for layout in layouts} == {1, 2, 4, 8}
    for layout in layouts:
        assert (layout.tp * layout.dp) % (layout.ep * layout.expert_tp) == 0
        assert layout.distributed_optimizer == (layout.edp > 1 or layout.dp > 1)
    assert {layout.expert_tp for layout in layouts if layout.tp == 4} == {1, 4}
    assert {layout.moe_dispatcher for layout in layouts if layout.ep > 1} == {"allgather", "alltoall"}
    assert {layout.ep for layout in candidates(preset("llama3-8b", 4096), 16, 8, 64, 4096)} == {1}


def test_fp8_param_gather_brings_the_distributed_optimizer_on_one_replica_too():
    fp8 = {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "fp8_param_gather": True}
    layouts = candidates(preset("llama3-8b", 4096), 8, 8, 8, 4096, SearchSpace(pp=(1,), fp8=fp8))
    assert any(layout.dp == 1 for layout in layouts)
    assert all(layout.distributed_optimizer and layout.fp8_param_gather for layout in layouts)


def test_uneven_split_is_the_nearest_even_split_there_is():
    """Oracle: every (first, last) that stage_layer_ranges accepts, by brute force."""
    for layers in range(2, 70):
        for stages in range(2, min(layers, 40) + 1):
            ceiling = -(-layers // stages)
            splits = {}
            for first, last in itertools.product(range(1, ceiling + 1), repeat=2):
                try:
                    sizes = [len(s) for s in stage_layer_ranges(layers, stages, first_stage_layers=first,
                                                                last_stage_layers=last)]
                except ConfigError:
                    continue
                if max(sizes) <= ceiling:   # no stage above the even share rounded up
                    splits[first, last] = sum((size - layers / stages) ** 2 for size in sizes)
            split = uneven_split(layers, stages)
            if layers % stages == 0:
                assert split == (None, None)
            elif not splits:
                assert split is None, (layers, stages)
            else:
                assert split in splits and splits[split] == pytest.approx(min(splits.values())), (layers, stages)
                assert split[0] >= split[1]   # the last stage, which runs the output layer, never holds more


def test_a_prime_layer_count_gets_pipelines():
    model = preset("deepseek-v3", 4096)   # 61 layers
    space = SearchSpace(tp=(4,), ep=(8,), etp=(1,), moe_dispatcher=("allgather",), micro_batch_size=(1,),
                        tp_comm_overlap=False)
    layouts = candidates(model, 1024, 8, 8192, 4096, space)
    assert {layout.pp for layout in layouts} == {1, 2, 4, 8, 16}   # 32 stages cannot hold 61 layers near evenly
    for layout in layouts:
        if layout.pp > 1:
            assert layout.uneven and sum(layout.stage_layers(61)) == 61
            assert max(layout.layers_per_rank(61)) == -(-61 // layout.pp)   # as even as it gets
    assert any(layout.virtual_stages > 1 for layout in layouts if layout.pp == 8)   # 16 stages: 3, 14 x 4, 2


def test_overlaps_are_searched_and_every_candidate_is_one_tessera_train_accepts():
    model = preset("llama3-8b", 4096)
    bf16 = candidates(model, 16, 8, 64, 4096, SearchSpace(framework="tessera", compiled=True))
    assert {layout.tp_comm_overlap for layout in bf16 if layout.tp > 1} == {False, True}
    assert all(layout.overlap_p2p_communication for layout in bf16 if layout.pp > 1)
    assert all(layout.overlap_grad_reduce and layout.overlap_param_gather for layout in bf16)
    # tessera train refuses --tp-comm-overlap with FP8 (its chunked GEMMs are bf16 ones)
    fp8 = candidates(model, 16, 8, 64, 4096, SearchSpace(framework="tessera", compiled=True,
                                                        fp8={"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}))
    assert any(layout.tp > 1 for layout in fp8) and not any(layout.tp_comm_overlap for layout in fp8)
    for layout in fp8 + [layout for layout in bf16 if layout.tp_comm_overlap]:
        config, _ = parse_run_config(["--model", "llama3-8b", "--seq-length", "4096", "--mock-data", "--lr", "1e-4",
                                      "--train-iters", "1", "--global-batch-size", "64", *layout.flags()], "test",
                                     world_size=16)
        parallel = config.parallel
        assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                parallel.virtual_pipeline_size(32), parallel.tp_comm_overlap, parallel.overlap_p2p_communication,
                parallel.overlap_grad_reduce, config.data_parallel_size) == (
            layout.tp, layout.pp, layout.virtual_stages, layout.tp_comm_overlap and layout.tp > 1,
            layout.overlap_p2p_communication and layout.pp > 1, layout.reduces_gradients, layout.dp)
        assert config.train.fp8_format == layout.fp8_format


def test_the_search_follows_rules_of_the_trainer_it_does_not_restate():
    # tessera train refuses context parallelism with dropout, and with multi-token prediction.
    long = {"seq_length": 8192, "max_position_embeddings": 8192}
    for name, changes in [("gpt3-1.3b", {}), ("tiny-deepseek", {})]:
        model = ModelConfig(**{**preset_values(name), **long, **changes})
        assert all(layout.cp == 1 for layout in candidates(model, 8, 8, 8, 8192))
    for name, changes in [("gpt3-1.3b", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
                          ("tiny-deepseek", {"mtp_num_layers": None})]:
        model = ModelConfig(**{**preset_values(name), **long, **changes})
        assert any(layout.cp > 1 for layout in candidates(model, 8, 8, 8, 8192))


def test_the_bounded_search_returns_what_predicting_every_candidate_would():
    model, space = preset("mixtral-8x7b", 4096), SearchSpace(framework="tessera", compiled=True,
                                                            micro_batch_size=(1, 2))
    steps = StepModel(model, DGX, CURVES, 4096)
    everything = []
    for layout in candidates(model, 16, 8, 64, 4096, space):
        prediction = predict(model, layout, DGX, CURVES, 64, 4096)
        assert step_time_bound(steps, layout, 64) <= prediction.step_time
        if prediction.memory.total <= usable_bytes(80):
            balanced = balance_pipeline(steps, layout)
            everything += [prediction] + ([predict(model, balanced, DGX, CURVES, 64, 4096)]
                                          if balanced != layout else [])
    fitting = sorted(p.step_time for p in everything if p.memory.total <= usable_bytes(80))
    assert len(fitting) > 5
    found = search(model, 16, DGX, CURVES, 64, 4096, space, top=5)
    assert [p.step_time for p in found] == pytest.approx(fitting[:5], rel=1e-12)

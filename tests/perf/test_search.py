"""Layout search: infeasible layouts rejected, textbook cases get the known-good family."""

import pytest

from tessera.config import ConfigError, ModelConfig
from tessera.models.presets import preset_values
from tessera.perf.cluster import CLUSTERS
from tessera.perf.kernels import load_curves
from tessera.perf.layout import Layout, check_layout
from tessera.perf.memory import usable_bytes
from tessera.perf.search import SearchSpace, candidates, search
from tessera.perf.simulator import predict

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

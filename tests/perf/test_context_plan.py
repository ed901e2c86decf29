"""The planner's context parallelism: it proposes CP for long sequences, times each
--cp-comm-type's traffic where it runs (the ring hidden behind attention, the all-gather and
all-to-all not), checks the heads a2a needs, and writes flags that `tessera train` accepts."""

import dataclasses

import pytest

from tessera.cli.args import parse_run_config
from tessera.config import ConfigError, ModelConfig
from tessera.models.presets import preset_values
from tessera.perf.cluster import CLUSTERS
from tessera.perf.kernels import load_curves
from tessera.perf.layout import Layout, check_layout
from tessera.perf.search import search
from tessera.perf.simulator import StepModel

DGX = CLUSTERS["dgx-h100"]
CURVES = load_curves(gpu_name="H100")
LONG = 65536


def llama3_8b(seq: int) -> ModelConfig:
    return ModelConfig(**{**preset_values("llama3-8b"), "seq_length": seq})


def test_llama3_8b_at_64k_on_8_gpus_is_planned_with_context_parallelism():
    best = search(llama3_8b(LONG), 8, DGX, CURVES, 16, LONG, top=1)[0]
    assert best.layout.cp > 1
    assert best.breakdown["cp_comm"] < 0.01 * best.step_time   # the ring hides behind attention in a node


def _traffic(kind: str, cp_a2a_size: int | None = None, gpus_per_node: int = 8) -> tuple[float, float]:
    """Forward and backward cp_comm seconds of one layer of llama3-8b at 64k, TP1 CP8."""
    cluster = dataclasses.replace(DGX, gpus_per_node=gpus_per_node)
    layout = Layout(cp=8, cp_comm_type=kind, cp_a2a_size=cp_a2a_size)
    fwd, bwd = StepModel(llama3_8b(LONG), cluster, CURVES, LONG).layer(layout)
    return fwd.times["cp_comm"], bwd.times["cp_comm"]


def test_each_comm_type_costs_what_it_cannot_hide():
    ring, gather, heads = _traffic("p2p"), _traffic("all_gather"), _traffic("a2a")
    model = llama3_8b(LONG)
    tokens, kv = LONG / 8, model.num_query_groups * model.kv_channels
    exchanged = 7 * DGX.send(tokens * 2 * kv * 2, across_nodes=False)   # 7 K, V blocks go round
    assert ring[0] < 0.5 * exchanged                 # beside the attention: only its interference shows
    assert gather[0] >= DGX.all_gather(8 * tokens * 2 * kv * 2, 8, 8)   # not hidden
    assert gather[1] > gather[0] and heads[1] == heads[0] > ring[0]
    # across two nodes of 4 GPUs: the hierarchical split keeps the all-to-all inside each node
    hierarchical, flat = _traffic("a2a+p2p", 4, gpus_per_node=4), _traffic("a2a", gpus_per_node=4)
    assert hierarchical[0] < flat[0]


def test_a2a_needs_heads_and_kv_groups_that_divide():
    model = llama3_8b(LONG)   # 32 heads, 8 KV groups
    check_layout(model, Layout(cp=8, cp_comm_type="a2a"), 8, LONG)
    with pytest.raises(ConfigError, match=r"--cp-comm-type a2a: attention heads \(32\) and KV groups \(8\)"):
        check_layout(model, Layout(cp=16, cp_comm_type="a2a"), 8, LONG)
    with pytest.raises(ConfigError, match="--cp-comm-type a2a\\+p2p needs --hierarchical-context-parallel-sizes"):
        check_layout(model, Layout(cp=8, cp_comm_type="a2a+p2p"), 8, LONG)


def test_planned_context_parallel_flags_are_accepted_by_tessera_train():
    layout = Layout(tp=2, cp=8, dp=1, cp_comm_type="a2a+p2p", cp_a2a_size=4, sequence_parallel=True)
    assert layout.describe().startswith("TP2 PP1 CP8(a2a4+p2p2)")
    config, _ = parse_run_config(["--model", "llama3-8b", "--seq-length", str(LONG), "--lr", "1e-4", "--train-iters", "1"]
                                 + layout.flags(), world_size=layout.gpus)
    assert config.parallel.cp_comm_type == ["a2a+p2p"]
    assert config.parallel.hierarchical_context_parallel_sizes == [4, 2]

"""Counting and planning DeepSeek-V3-style models: parameters against the published sizes,
multi-latent attention's saved activations against autograd, the MTP depths on the last
pipeline stage, and `tessera plan` for DeepSeek-V3's layouts (1024 H100 as TP2 PP16 EP64;
2048 H800 as the V3 report's PP16 EP64 without TP)."""

import dataclasses
import json

import pytest
import torch

from tessera.cli import plan, run
from tessera.config import ModelConfig
from tessera.models.presets import preset_values
from tessera.perf.flops import count_parameters
from tessera.perf.layout import Layout
from tessera.perf.memory import GIB, layer_activation_bytes, mtp_parameters, stage_parameters, usable_bytes
from tessera.perf.search import uneven_split
from tests.perf.saved_tensors import bytes_saved_for_backward


def preset(name: str, **changes) -> ModelConfig:
    return ModelConfig(**{**preset_values(name), **changes})


def test_deepseek_sizes_are_the_published_ones():
    """DeepSeek-V3's README_WEIGHTS.md: the main model 671B, of them 36.6B activated "including
    0.9B for the output Head" (the "37B" of its model card, rounded), i.e. without the input
    embedding, whose one row a token reads; the MTP module 11.5B more, not counting the shared
    embedding and head. tessera's active count keeps the input embedding too (as for Mixtral's
    12.9B): 37.55B. V2-Lite 15.7B; Moonlight 16B with 3B activated (B = 1e9)."""
    v3 = preset("deepseek-v3")
    main = count_parameters(dataclasses.replace(v3, mtp_num_layers=None))
    input_embedding = v3.padded_vocab_size() * v3.hidden_size
    assert main.total / 1e9 == pytest.approx(671, rel=0.005)
    assert (main.active - input_embedding) / 1e9 == pytest.approx(36.6, rel=0.005)
    assert round(main.active / 1e9) == 38 and round((main.active - input_embedding) / 1e9) == 37
    assert count_parameters(v3).mtp / 1e9 == pytest.approx(11.5, rel=0.015)
    assert count_parameters(v3).total == main.total + count_parameters(v3).mtp
    assert count_parameters(preset("deepseek-v2-lite")).total / 1e9 == pytest.approx(15.7, abs=0.06)
    moonlight = count_parameters(preset("moonlight-16b-a3b"))
    assert (round(moonlight.total / 1e9), round(moonlight.active / 1e9)) == (16, 3)


def test_tessera_flops_reports_the_main_model_and_the_mtp_depths_apart(capsys):
    assert run(["flops", "--model", "deepseek-v3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] / 1e9 == pytest.approx(671, rel=0.005)
    assert report["active_parameters_without_input_embedding"] / 1e9 == pytest.approx(36.6, rel=0.005)
    assert report["mtp_parameters"] == count_parameters(preset("deepseek-v3")).mtp
    assert run(["flops", "--model", "deepseek-v3"]) == 0
    assert "671.026 B" in capsys.readouterr().out


def test_mla_layer_activations_are_what_autograd_saves():
    """The oracle is autograd, as in test_memory.py: bytes of the tensors a compiled tessera MLA
    block (bf16 autocast over fp32 weights) saves for backward, counted with saved-tensor hooks;
    the attention core is recomputed (selective), since on CPU SDPA falls back to its math
    kernel for values narrower than keys, which keeps the scores a GPU kernel does not. (Without
    q-LoRA the count matched too, to the byte; one compiled case keeps the test's time down.)"""
    from tessera.models.gpt import GPTModel, Recompute

    b, s, h = 2, 96, 320   # b*s, h and every MLA width differ, so shapes tell tensors apart
    config = preset("tiny-deepseek", num_layers=1, moe_layer_freq="[0]", hidden_size=h, ffn_hidden_size=1280,
                    q_lora_rank=144, kv_lora_rank=112, qk_head_dim=40, qk_pos_emb_head_dim=16, v_head_dim=24,
                    seq_length=s, yarn_original_max_position_embeddings=24, mtp_num_layers=None)
    model = GPTModel(config, recompute=Recompute("selective")).train()
    block = model.layers[0]
    block.compile()
    x = torch.randn(b, s, h, requires_grad=True)
    saved = bytes_saved_for_backward(block, x, model.rotary(s, None), smaller_left_out=2 * b * s * 16)
    layout = Layout(micro_batch_size=b, compiled=True, framework="tessera", recompute="selective")
    assert saved == pytest.approx(layer_activation_bytes(config, layout, s), rel=0.005)


def test_the_mtp_depths_live_on_the_last_stage():
    """tiny-deepseek over two pipeline ranks (layers 0-1 | 2 and the MTP depth): every parameter
    counted once, plus the last stage's own copy of the word embedding (the MTP depth's input);
    the depth's experts split by EP."""
    model = preset("tiny-deepseek")
    vocab, h = model.padded_vocab_size(), model.hidden_size
    first, last = (stage_parameters(model, Layout(pp=2, first_stage_layers=2), vocab, rank) for rank in (0, 1))
    assert first.total + last.total == count_parameters(model).total + vocab * h
    mtp = mtp_parameters(model)
    assert mtp.dense + mtp.experts == count_parameters(model).mtp and mtp.experts == 16 * 3 * 64 * 16
    split = stage_parameters(model, Layout(pp=2, dp=2, ep=2, first_stage_layers=2), vocab, 1)
    assert split.experts == last.experts / 2


def test_an_uneven_layer_count_gets_the_split_nearest_even():
    assert uneven_split(61, 16) == (3, 2)   # 3 + 14 x 4 + 2
    assert uneven_split(27, 4) == (7, 6)    # 7 + 2 x 7 + 6
    assert uneven_split(32, 4) == (None, None)
    assert uneven_split(61, 32) is None     # 29 stages of 2 and 3 of 1: more than first and last can take


def _plan(capsys, *argv) -> list[dict]:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("gpus, gpu, tp", [(1024, "h100", 2), (2048, "h800", 1)])
def test_plan_fits_deepseek_v3_in_80_gb_on_its_layouts(capsys, gpus, gpu, tp):
    """TP x PP16 x EP64 held fixed, batch 15360 x 4096 (the V3 report's): the planner splits the
    61 layers unevenly, picks the recompute that fits, and explains memory and time by term."""
    results = _plan(capsys, "--model", "deepseek-v3", "--gpus", str(gpus), "--gpu", gpu,
                    "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "16",
                    "--expert-model-parallel-size", "64", "--global-batch-size", "15360", "--seq-length", "4096")
    assert results
    capacity = usable_bytes(80) / GIB
    for result in results:
        layout = result["layout"]
        assert (layout["tp"], layout["pp"], layout["ep"], layout["dp"]) == (tp, 16, 64, gpus // (16 * tp))
        assert layout["first_stage_layers"] or layout["last_stage_layers"]
        assert result["fits"] and result["memory_gib_per_gpu"] <= capacity
        assert 0 < result["mfu"] < 1
        assert {"ep_comm", "expert_gemm", "attention", "pp_bubble"} <= result["time_s"].keys()
        assert result["memory_gib"]["activations"] > 0 and result["expert_state_gib"] > 0
    best = results[0]
    assert best["step_time_s"] == min(result["step_time_s"] for result in results)
    if tp == 1:   # each GPU holds twice TP2's activations: over 100 GiB unless some are recomputed
        assert best["layout"]["recompute"] in ("selective", "full")
    assert ("--recompute-granularity" in best["layout"]["flags"]) == (best["layout"]["recompute"] != "none")
    assert sum(best["time_s"].values()) == pytest.approx(best["step_time_s"])

"""`tessera plan` from the command line."""

import json

import pytest

from tessera.cli import plan
from tessera.cli.args import parse_run_config
from tessera.parallel.pipeline_schedules import stage_layer_ranges
from tessera.perf.layout import Layout


def run_json(capsys, *argv):
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_search_prints_machine_readable_layouts(capsys):
    results = run_json(capsys, "--model", "llama3-8b", "--gpus", "16", "--global-batch-size", "64",
                       "--seq-length", "4096", "--top", "2")
    assert len(results) == 2
    for result in results:
        for key in ("mfu", "tflops_per_gpu", "step_time_s", "tokens_per_sec", "memory_gb_per_gpu", "layout"):
            assert key in result
        assert 0 < result["mfu"] < 1 and result["fits"]
    assert results[0]["step_time_s"] <= results[1]["step_time_s"]


def test_given_flags_are_held_fixed_and_explain_predicts_exactly_them(capsys):
    fixed = run_json(capsys, "--model", "llama3-8b", "--gpus", "16", "--global-batch-size", "64",
                     "--tensor-model-parallel-size", "4", "--top", "3")
    assert all(r["layout"]["tp"] == 4 for r in fixed)
    explained = run_json(capsys, "--model", "gpt3-175b", "--gpus", "1024", "--global-batch-size", "1536",
                         "--explain", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                         "--num-layers-per-virtual-pipeline-stage", "3", "--sequence-parallel",
                         "--use-distributed-optimizer", "--tp-comm-overlap")
    layout = explained[0]["layout"]
    assert (layout["tp"], layout["pp"], layout["dp"], layout["virtual_stages"]) == (8, 8, 16, 4)
    assert layout["tp_comm_overlap"] and "--virtual-pipeline-model-parallel-size" in layout["flags"]


def test_a_pipeline_is_balanced_and_its_flags_split_the_model_as_tessera_train_does(capsys):
    # GPT 1.3B on two H200s: the last stage also runs the 50k-word output layer and loss,
    # about two layers' worth, so the planner moves a layer to the first stage (measured:
    # 13/11 beats 12/12 by 4%, docs/performance-notes.md).
    common = ["--model", "gpt3-1.3b", "--seq-length", "2048", "--gpu", "h200", "--gpus", "2",
              "--global-batch-size", "64", "--micro-batch-size", "8", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--pipeline-model-parallel-size", "2"]
    best = run_json(capsys, *common, "--top", "1")[0]
    even = run_json(capsys, *common, "--explain")[0]
    assert best["step_time_s"] < even["step_time_s"]
    config, _ = parse_run_config(["--model", "gpt3-1.3b", "--mock-data", "--lr", "1e-4", "--train-iters", "1",
                                  *best["layout"]["flags"]], "test",
                                 world_size=2)
    split = stage_layer_ranges(24, 2, config.parallel.virtual_pipeline_size(24),
                               first_stage_layers=config.parallel.decoder_first_pipeline_num_layers,
                               last_stage_layers=config.parallel.decoder_last_pipeline_num_layers)
    assert [len(stage) for stage in split] == Layout(**{
        k: v for k, v in best["layout"].items() if k not in ("flags", "describe")}).stage_layers(24)
    assert sum(len(stage) for stage in split[::2]) == 13   # first pipeline rank (chunks 0, 2, ...)
    explained = run_json(capsys, *common, "--explain", *best["layout"]["flags"])[0]
    assert explained["step_time_s"] == pytest.approx(best["step_time_s"])


def test_explain_reports_a_layout_that_does_not_fit(capsys):
    result = run_json(capsys, "--model", "llama3-70b", "--explain", "--global-batch-size", "1")
    assert not result[0]["fits"] and result[0]["memory_gib_per_gpu"] > 80


def test_errors_are_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(["--model", "llama3-8b", "--global-batch-size", "8"])
    assert exit_info.value.code == 2
    assert "--gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--model", "llama3-8b", "--explain", "--tensor-model-parallel-size", "5"])
    assert "--tensor-model-parallel-size" in capsys.readouterr().err


def test_mixtral_8x7b_on_64_gpus_fits_with_expert_parallelism(capsys):
    best = run_json(capsys, "--model", "mixtral-8x7b", "--gpus", "64", "--top", "1")[0]
    layout = best["layout"]
    assert best["fits"] and layout["ep"] > 1   # within 80 GB
    assert 0.2 < best["mfu"] < 0.6 and best["time_s"]["expert_gemm"] > best["time_s"]["gemm"]
    assert best["tokens_per_sec"] * best["step_time_s"] == pytest.approx(256 * 4096)   # ~1M tokens by default
    parse_run_config(["--model", "mixtral-8x7b", "--mock-data", "--lr", "1e-4", "--train-iters", "1",
                      "--global-batch-size", "256", *layout["flags"]], "test", world_size=64)


def test_mixtral_8x22b_on_256_gpus_in_tp4_pp4_ep8(capsys):
    common = ["--model", "mixtral-8x22b", "--gpus", "256", "--tensor-model-parallel-size", "4",
              "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8"]
    searched = run_json(capsys, *common, "--top", "1")[0]
    held = searched["layout"]
    assert searched["fits"] and (held["tp"], held["pp"], held["ep"]) == (4, 4, 8)
    explain = [*common, "--explain", "--global-batch-size", "256", "--sequence-parallel", "--use-distributed-optimizer"]
    explained = run_json(capsys, *explain)[0]
    assert explained["layout"]["dp"] == 16 and explained["layout"]["etp"] is None   # expert-TP = TP, as in Megatron
    assert explained["fits"] and explained["step_time_s"] > searched["step_time_s"]
    # EP 8 x ETP 4 spans four nodes; expert-TP 1 keeps the EP group in one node: less to send,
    # but each GPU holds its expert whole.
    narrow = run_json(capsys, *explain, "--expert-tensor-parallel-size", "1")[0]
    assert narrow["time_s"]["ep_comm"] < explained["time_s"]["ep_comm"]
    assert narrow["expert_state_gib"] > explained["expert_state_gib"]


def test_an_impossible_expert_layout_is_refused_naming_the_flag(capsys):
    for gpus, flags, named in [("96", ["--expert-model-parallel-size", "3"], "--num-experts (8) must be divisible"),
                               ("4", ["--expert-model-parallel-size", "8"], "--expert-model-parallel-size (8) x"),
                               ("96", ["--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "3"],
                                "--moe-ffn-hidden-size"),
                               ("8", ["--tensor-model-parallel-size", "2"], "--sequence-parallel")]:
        with pytest.raises(SystemExit):
            plan.main(["--model", "mixtral-8x7b", "--gpus", gpus, "--explain", *flags])
        assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--model", "llama3-8b", "--explain", "--expert-model-parallel-size", "2"])
    assert "--num-experts" in capsys.readouterr().err


def test_bf16_moments_shrink_the_optimizer_state_and_step(capsys):
    """--use-precision-aware-optimizer --exp-avg(-sq)-dtype bf16: 2 + 2 + 2 bytes of state a parameter
    (the masters' remainders, the moments) instead of 4 + 4 + 4, and an optimizer pass 10 bytes lighter
    (of 34, plus zeroing the gradient)."""
    layout = ["--model", "llama3-8b", "--gpus", "8", "--gpu", "h200", "--use-distributed-optimizer", "--explain",
              "--tensor-model-parallel-size", "1", "--micro-batch-size", "1"]
    (fp32,) = run_json(capsys, *layout)
    (bf16,) = run_json(capsys, *layout, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                       "--exp-avg-sq-dtype", "bf16")
    assert bf16["memory_gib"]["optimizer"] == pytest.approx(fp32["memory_gib"]["optimizer"] * 6 / 12)
    assert bf16["memory_gib"]["weights"] == fp32["memory_gib"]["weights"]
    assert bf16["time_s"]["optimizer"] < fp32["time_s"]["optimizer"]
    assert bf16["layout"]["exp_avg_dtype"] == bf16["layout"]["exp_avg_sq_dtype"] == "bf16"
    assert "--exp-avg-sq-dtype" in bf16["layout"]["flags"] and "--exp-avg-dtype" not in fp32["layout"]["flags"]


DEEPSEEK = ["--model", "deepseek-v3", "--gpus", "1024", "--gpu", "h100", "--global-batch-size", "8192"]


def test_deepseek_v3_gets_a_pipeline_at_least_as_fast_as_megatrons_production_layout(capsys):
    """61 layers (a prime): the search must reach pipelines through uneven first/last stages, and
    its pick must predict at least Megatron's production layout (TP2 PP16 EP64, expert-TP 1, its
    parallelism guide) completed by the same planner."""
    best = run_json(capsys, *DEEPSEEK, "--top", "1")[0]
    production = run_json(capsys, *DEEPSEEK, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                          "16", "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1",
                          "--top", "1")[0]
    assert production["fits"] and (production["layout"]["tp"], production["layout"]["pp"]) == (2, 16)
    assert best["fits"] and best["tokens_per_sec"] >= production["tokens_per_sec"]
    # The flags it prints reproduce the split: tessera train accepts them and splits the layers alike.
    layout = best["layout"]
    assert layout["pp"] > 1 and {"--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"} & set(
        layout["flags"])
    config, _ = parse_run_config(["--model", "deepseek-v3", "--mock-data", "--lr", "1e-4", "--train-iters", "1",
                                  "--global-batch-size", "8192", *layout["flags"]], "test", world_size=1024)
    parallel = config.parallel
    split = stage_layer_ranges(61, parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_size(61),
                               first_stage_layers=parallel.decoder_first_pipeline_num_layers,
                               last_stage_layers=parallel.decoder_last_pipeline_num_layers)
    planned = Layout(**{k: v for k, v in layout.items() if k not in ("flags", "describe")})
    assert [len(stage) for stage in split] == planned.stage_layers(61)
    assert (parallel.tp_comm_overlap, parallel.sequence_parallel) == (layout["tp_comm_overlap"], True)


def test_without_a_batch_the_search_says_which_default_it_took(capsys):
    for gpus, seq, batch in [("16", "8192", 128), ("1024", "8192", 512)]:   # 2^20 tokens; 4,096 a GPU
        assert plan.main(["--model", "llama3-8b", "--gpus", gpus, "--seq-length", seq, "--top", "1"]) == 0
        out = capsys.readouterr().out
        assert f"global batch {batch} sequences of {seq}: a default" in out and "--global-batch-size" in out
        assert f"--global-batch-size {batch}" in out.split("train with:")[1]
    result = run_json(capsys, "--model", "llama3-8b", "--gpus", "16", "--top", "1")[0]
    assert result["tokens_per_sec"] * result["step_time_s"] == pytest.approx(128 * 8192)
    assert plan.main(["--model", "llama3-8b", "--gpus", "16", "--global-batch-size", "64", "--top", "1"]) == 0
    assert "a default" not in capsys.readouterr().out


@pytest.mark.parametrize("flags, distributed_optimizer, fsdp", [
    (["--data-parallel-sharding-strategy", "optim"], True, False),
    (["--data-parallel-sharding-strategy", "optim_grads_params"], False, True),
    (["--use-megatron-fsdp"], False, True),
    (["--use-custom-fsdp", "--use-distributed-optimizer"], False, True),   # Megatron-FSDP's own scripts
    (["--data-parallel-sharding-strategy", "no_shard"], False, False),
])
def test_the_sharding_flags_are_read_as_tessera_train_reads_them(capsys, flags, distributed_optimizer, fsdp):
    layout = run_json(capsys, "--model", "llama3-8b", "--gpus", "8", "--explain", "--tensor-model-parallel-size",
                      "1", "--pipeline-model-parallel-size", "1", *flags)[0]["layout"]
    assert (layout["distributed_optimizer"], layout["fsdp"]) == (distributed_optimizer, fsdp)

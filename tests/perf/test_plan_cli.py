"""`tessera plan` from the command line."""

import json

import pytest

from tessera.cli import plan


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
    assert layout["tp_comm_overlap"] and "--num-layers-per-virtual-pipeline-stage" in layout["flags"]


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

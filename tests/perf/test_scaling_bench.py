"""bench/scaling.py, the weak, strong and MoE ladders, on the CPU: each point's command is a run `tessera train`
accepts with the planner's layout, and the figures draw from a ladder's JSON (measured or not).
The runs themselves need an 8-GPU host."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.cli.args import parse_run_config

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scaling.py"
sys.path.insert(0, str(BENCH.parent))
import scaling  # noqa: E402
from train_mfu import COMMON, CONFIGS  # noqa: E402


def _points(ladder, gpus, extra=()):
    return [scaling.plan_point(*point, list(extra)) for point in scaling.LADDERS[ladder](gpus)]


@pytest.mark.parametrize("ladder, gpus, models", [
    ("weak", [1, 4], ["gpt3-1.3b", "gpt3-6.7b"]), ("strong", [2, 8], ["gpt3-6.7b"] * 2),
    ("moe", [1, 8], ["config M"]),   # EP over every GPU: from 2
])
def test_each_point_runs_the_planners_layout(ladder, gpus, models):
    points = _points(ladder, gpus)
    assert [p["model"] for p in points] == models
    for point in points:
        command = point["command"]
        assert command[:3] == ["torchrun", "--nproc-per-node", str(point["gpus"])]
        config = command[command.index("--config") + 1]
        flags = COMMON + CONFIGS[config] + ["--train-iters", "1"] + command[command.index("--") + 1:]
        run, _ = parse_run_config(flags, "test", world_size=point["gpus"])   # what train_mfu.py will run
        layout = point["predicted"]["layout"]
        assert run.parallel.tensor_model_parallel_size == int(layout[layout.index("--tensor-model-parallel-size") + 1])
        assert run.train.micro_batch_size == int(layout[layout.index("--micro-batch-size") + 1])
        assert run.train.global_batch_size == point["global_batch_size"]
        assert 0.2 < point["predicted"]["mfu"] < 0.8 and point["measured"] is None
        if ladder == "moe":
            assert run.parallel.expert_model_parallel_size == point["gpus"]
    if ladder == "weak":   # global batch 16 a GPU
        assert [p["global_batch_size"] for p in points] == [16, 64]


def test_fp8_flags_reach_the_plan_and_every_run():
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    (point,), (bf16,) = _points("strong", [2], fp8), _points("strong", [2])
    assert point["command"][-4:] == fp8
    assert "--tp-comm-overlap" not in point["command"]   # refused with FP8
    assert point["predicted"]["tflops_per_gpu"] > bf16["predicted"]["tflops_per_gpu"]


def test_a_dry_run_writes_the_ladder_and_its_commands(tmp_path):
    subprocess.run([sys.executable, str(BENCH), "--ladder", "weak", "--gpus", "1", "2", "--out", str(tmp_path),
                    "--dry-run"], check=True, capture_output=True, timeout=120)
    result = json.loads((tmp_path / "weak.json").read_text())
    assert [p["gpus"] for p in result["points"]] == [1, 2] and result["ladder"] == "weak"


def test_figures_draw_measured_points_beside_predicted_ones(tmp_path):
    def point(gpus, model, measured):
        return {"gpus": gpus, "model": model, "predicted": {"mfu": 0.55},
                "measured": {"mfu": measured} if measured else None}

    (tmp_path / "weak.json").write_text(json.dumps({"points": [
        point(1, "gpt3-1.3b", 0.52), point(2, "gpt3-2.7b", 0.53), point(4, "gpt3-6.7b", None)]}))
    (tmp_path / "strong.json").write_text(json.dumps({"points": [point(1, "gpt3-6.7b", 0.6), point(8, "gpt3-6.7b", 0.5)]}))
    drawn = scaling.draw(tmp_path)
    assert [p.name for p in drawn] == ["weak.png", "strong.png"]
    assert all(p.stat().st_size > 10_000 for p in drawn)


def test_the_published_figures_still_draw(tmp_path):
    from tessera.cli import plan

    assert plan.main(["--published", "--figures", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["strong_scaling.png", "weak_scaling.png"]



def test_the_two_gpu_runs_are_runs_tessera_accepts_with_a_prediction_each():
    import two_gpus

    for name, (config, flags) in two_gpus.RUNS.items():
        run, _ = parse_run_config(COMMON + CONFIGS[config] + ["--train-iters", "1"] + flags, "test", world_size=2)
        parallel = run.parallel
        assert parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size * \
            parallel.context_parallel_size * run.data_parallel_size == 2, name
    gathered, plain = (two_gpus.predict(*two_gpus.RUNS[name]) for name in ("B FP8 DP=2, --fp8-param-gather", "B FP8 DP=2"))
    assert gathered["layout"]["fp8_param_gather"] and gathered["fits"]
    assert gathered["time_s"]["dp_comm"] < plain["time_s"]["dp_comm"]

"""The commands as a user runs them: `python -m tessera train/flops`, in a subprocess."""

import json
import os
import subprocess
import sys

import pytest

KEYS = {"iteration", "consumed_samples", "loss", "lr", "grad_norm", "loss_scale", "skipped_iterations",
        "tokens_per_sec", "tflops_per_gpu", "mfu", "mem_gb"}


def tessera(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True, timeout=300)


def test_train_mock_data_prints_metric_lines_and_writes_json(tmp_path):
    log = tmp_path / "train.jsonl"
    result = tessera("train", "--model", "tiny-gpt", "--mock-data", "--train-iters", "6", "--lr", "1e-3",
                     "--micro-batch-size", "2", "--log-interval", "2", "--log-json", str(log),
                     "--eval-interval", "6", "--eval-iters", "1")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "iteration " in line and "lm loss:" in line]
    assert len(lines) == 3
    for field in ("consumed samples", "elapsed time per iteration (ms)", "TFLOP/s/GPU", "MFU: n/a", "tokens/s",
                  "learning rate", "grad norm", "loss scale", "number of skipped iterations", "mem:"):
        assert field in lines[0]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(KEYS <= set(r) for r in records if "loss" in r)
    assert any("eval_loss" in r and "eval_ppl" in r for r in records)
    assert records[0]["mfu"] is None  # CPU: no peak, unless --peak-tflops


def test_peak_tflops_override_gives_mfu(tmp_path):
    log = tmp_path / "train.jsonl"
    result = tessera("train", "--model", "tiny-gpt", "--mock-data", "--train-iters", "2", "--lr", "1e-3",
                     "--log-interval", "1", "--log-json", str(log), "--peak-tflops", "0.001")
    assert result.returncode == 0, result.stderr
    record = json.loads(log.read_text().splitlines()[-1])
    assert record["mfu"] == pytest.approx(record["tflops_per_gpu"] / 0.001)


def test_tensorboard_scalars(tmp_path):
    result = tessera("train", "--model", "tiny-gpt", "--mock-data", "--train-iters", "2", "--lr", "1e-3",
                     "--log-interval", "1", "--tensorboard-dir", str(tmp_path / "tb"))
    assert result.returncode == 0, result.stderr
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_unknown_flag_is_one_line():
    result = tessera("train", "--model", "tiny-gpt", "--lr", "1", "--train-iters", "1", "--mock-dat")
    assert result.returncode == 2
    assert result.stderr.strip() == ("tessera train: error: unrecognized arguments: "
                                     "--mock-dat (did you mean --mock-data?)")


def test_help_groups_flags():
    result = tessera("train", "--help")
    assert result.returncode == 0
    for heading in ("model (", "parallel (", "optim (", "train (", "data ("):
        assert heading in result.stdout
    assert "--num-layers" in result.stdout and "--lr-decay-style" in result.stdout


def test_flops_json_and_mfu():
    result = tessera("flops", "--model", "gpt3-1.3b", "--global-batch-size", "8", "--iter-time", "0.2746",
                     "--gpu", "h200", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["parameters"] == 1_315_819_520     # config A of bench/train_mfu.py (GPT 1.3B)
    tflops = 8 * 2048 * report["flops_per_token"] / 0.2746 / 1e12
    assert report["tflops_per_gpu"] == pytest.approx(tflops)
    assert report["mfu"] == pytest.approx(tflops / 989.0)


def test_unknown_command():
    result = tessera("trian")
    assert result.returncode == 2 and "unknown command 'trian'" in result.stderr


def test_a_bad_context_parallel_layout_is_refused_at_start():
    # Refused before any process group is joined, so one process can stand for two.
    result = subprocess.run([sys.executable, "-m", "tessera", "train", "--model", "tiny-gpt", "--mock-data", "--lr",
                             "1", "--train-iters", "1", "--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "WORLD_SIZE": "2"})
    assert result.returncode == 2
    assert "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes" in result.stderr


@pytest.mark.parametrize("rank, local_rank", [("0", "0"), ("1", "1"), ("1", "0")])
def test_a_command_line_error_is_printed_once_a_node(rank, local_rank):
    """The ranks of a node parse the same flags: one copy of the error per node, not one per rank."""
    result = subprocess.run([sys.executable, "-m", "tessera", "train", "--model", "tiny-gpt", "--mock-data", "--lr",
                             "1", "--train-iters", "1", "--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "WORLD_SIZE": "2", "RANK": rank, "LOCAL_RANK": local_rank})
    assert result.returncode == 2
    assert ("--cp-comm-type a2a+p2p" in result.stderr) == (local_rank == "0")


def test_expert_parallelism_needs_experts():
    result = tessera("train", "--model", "tiny-gpt", "--mock-data", "--lr", "1", "--train-iters", "1",
                     "--expert-model-parallel-size", "2")
    assert result.returncode == 2 and "--expert-model-parallel-size / --expert-tensor-parallel-size need " \
        "--num-experts" in result.stderr


def test_print_schedule_without_launching():
    result = subprocess.run(
        [sys.executable, "-m", "tessera", "train", "--model", "tiny-llama", "--mock-data", "--lr", "1",
         "--train-iters", "1", "--pipeline-model-parallel-size", "2", "--print-schedule",
         "--micro-batch-size", "1", "--global-batch-size", "4"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "WORLD_SIZE": "2"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("1f1b schedule: 2 pipeline ranks") and "bubble 20.0%" in lines[0]
    rank0 = next(line for line in lines if line.startswith("rank 0:"))
    assert rank0.count(" F") == 4 and rank0.count(" B") == 4   # every micro-batch forward and backward


def test_flops_of_a_moe_model_count_its_active_parameters():
    result = tessera("flops", "--model", "mixtral-8x7b", "--global-batch-size", "256")
    assert result.returncode == 0, result.stderr
    assert "46.703 B" in result.stdout and "active per token:       12.880 B  (2 of 8 experts" in result.stdout
    report = json.loads(tessera("flops", "--model", "mixtral-8x7b", "--json").stdout)
    assert report["active_parameters"] == 12_879_925_248
    # Megatron's formula per token: 6 x the active GEMM weights (not the input embedding, the
    # router or the norms) + causal attention.
    embedding, router, norms, attention = 32000 * 4096, 32 * 8 * 4096, 65 * 4096, 6 * 32 * 4096 * 4096
    gemm_weights = report["active_parameters"] - embedding - router - norms
    assert report["flops_per_token"] == pytest.approx(6 * gemm_weights + attention, rel=1e-12)


def test_plan_names_the_expert_layout_to_train_with():
    result = tessera("plan", "--model", "mixtral-8x7b", "--gpus", "64", "--top", "1")
    assert result.returncode == 0, result.stderr
    assert "46.7B parameters, 12.9B active per token; global batch 256 x seq 4096" in result.stdout
    assert "--expert-model-parallel-size" in result.stdout.splitlines()[-1]

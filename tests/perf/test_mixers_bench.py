"""bench/mixers.py on the CPU with its --tiny shapes: every row runs in this process (the GPU-only
ones say why they cannot), tessera's scans agree with transformers' PyTorch paths on the rows'
inputs, and the dense GPT-OSS row has the MoE row's FLOPs per token."""

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import mixers  # noqa: E402
from tessera.perf.flops import flops_per_token  # noqa: E402

CPU_ONLY_REASONS = ("needs CUDA", "not available", "skipped off CUDA")


@pytest.fixture(scope="module")
def records():
    rows = []
    args = mixers.parse_args(["--tiny"])
    for names in mixers.PARTS.values():
        for name in names:
            args.row = name
            rows += _run(args)
    return rows


def _run(args) -> list[dict]:
    """The records `run_row` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        mixers.run_row(args)
    return [json.loads(line[4:]) for line in out.getvalue().splitlines() if line.startswith("ROW ")]


def test_every_row_runs_or_names_its_gpu_need(records):
    assert {r["name"] for r in records} == {name for names in mixers.PARTS.values() for name in names}
    for record in records:
        if "error" in record:
            assert any(reason in record["error"] for reason in CPU_ONLY_REASONS), record
        else:
            assert any(record.get(key, 0) > 0 for key in ("ms", "tokens_per_sec", "tokens_per_s")), record
    lines = mixers.compare(records)
    assert len(lines) == 4 and all(mixers.describe(r) for r in records)   # train, gpt-oss, decode at 2 batches


def test_tesseras_scans_match_transformers(records):
    checked = [r for r in records if r["row"].startswith("transformers") and "max_abs_diff_vs_tessera" in r]
    assert {r["name"] for r in checked} == {"mamba", "gdn"}
    for record in checked:   # fp32 on both sides, chunked differently
        assert record["max_abs_diff_vs_tessera"] <= 1e-5 * max(1.0, record["tessera_max_abs"]), record


def test_the_dense_gpt_oss_has_the_moe_flops_per_token(tmp_path):
    args = mixers.parse_args([])
    moe, dense = (mixers.model_config(mixers.model_flags(row, args, str(tmp_path)))
                  for row in ("gpt-oss-moe", "gpt-oss-dense"))
    assert moe.num_experts == 32 and dense.num_experts is None
    assert dense.ffn_hidden_size == moe.moe_router_topk * moe.moe_ffn_hidden_size
    assert flops_per_token(dense) == pytest.approx(flops_per_token(moe), rel=1e-3)


def test_a_row_past_its_time_is_killed_with_what_it_printed():
    command = [sys.executable, "-c", "import time; print('ROW {}', flush=True); time.sleep(60)"]
    out, _, failure = mixers.run_process(command, timeout=1)
    assert out.startswith("ROW {}") and failure.startswith("timed out")

"""bench/fp8_loss_parity.py: its runs record what the trainer logged, and its summary measures each
recipe's final validation loss against bf16's (docs/performance.md's FP8 parity row reads that gap)."""

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from fp8_loss_parity import summarize  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fp8_loss_parity.py"


def test_the_gap_is_relative_to_the_bf16_run_final_validation_loss():
    runs = [dict(recipe="tensorwise", evals=[(50, 4.0), (100, 3.03)], skipped=0, nonfinite=0),
            dict(recipe="bf16", evals=[(50, 4.1), (100, 3.0)], skipped=0, nonfinite=0),
            dict(recipe="blockwise", evals=[(50, 4.2), (100, 2.97)], skipped=2, nonfinite=1)]
    rows = {row["recipe"]: row for row in summarize(runs)}
    assert rows["tensorwise"]["gap_to_bf16"] == (3.03 - 3.0) / 3.0
    assert rows["blockwise"]["gap_to_bf16"] == (2.97 - 3.0) / 3.0
    assert rows["bf16"]["gap_to_bf16"] == 0.0
    assert (rows["blockwise"]["skipped"], rows["blockwise"]["nonfinite"]) == (2, 1)
    assert summarize(runs[:1])[0]["gap_to_bf16"] is None   # no bf16 run to compare with


def test_a_tiny_run_writes_its_validation_curve(tmp_path):
    """--at-once: the run is trained in a process of its own (the in-process path) and read back."""
    out, png = tmp_path / "parity.json", tmp_path / "parity.png"
    subprocess.run([sys.executable, str(BENCH), "--size", "tiny", "--steps", "12", "--eval-interval", "4",
                    "--recipes", "bf16", "--at-once", "--work", str(tmp_path / "work"), "--out", str(out),
                    "--plot", str(png)],
                   check=True, capture_output=True, timeout=240)
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert [step for step, _ in run["evals"]] == [4, 8, 12]
    assert len(run["losses"]) == 12 and run["skipped"] == 0
    assert result["summary"][0]["final_eval_loss"] == run["evals"][-1][1]
    assert png.stat().st_size > 10_000

"""examples/grpo.py's quick path: SFT to about half the held-out answers, 20 GRPO steps from its
checkpoint, and the held-out accuracy read before and after (the full run, 200 GRPO steps, is
not part of the suite). On one thread, as the example runs from the command line, 20 steps
raise the accuracy by 22 to 32 points for model seeds 3, 4 and 5. The same run writes its
--curve JSON; --plot draws one."""

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_grpo_example_raises_held_out_accuracy(example, capsys, one_thread, tmp_path):
    curve_path = tmp_path / "curve.json"
    assert example.main(["--quick", "--curve", str(curve_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "held-out accuracy" in line]
    assert len(lines) == 2 and lines[0].startswith("after SFT") and lines[1].startswith("after GRPO")
    before, after = (int(re.search(r"accuracy (\d+)%", line)[1]) for line in lines)
    assert 20 <= before <= 70, lines[0]   # SFT leaves GRPO prompts to learn from
    assert after >= before + 10, lines
    curve = json.loads(curve_path.read_text())
    assert [s["step"] for s in curve["steps"]] == list(range(1, 21))   # one entry per GRPO step
    for name in ("reward", "reward_std", "rewards/exact_match/mean", "kl", "clip_ratio", "completions/mean_length",
                 "rollout_seconds", "train_seconds"):
        assert all(math.isfinite(s[name]) for s in curve["steps"]), name
    assert (round(100 * curve["held_out_accuracy"]["before"]), round(100 * curve["held_out_accuracy"]["after"])) \
        == (before, after)
    assert not list(tmp_path.glob("*.tmp"))


def test_plot_draws_a_curve_as_a_png(example, tmp_path):
    pytest.importorskip("matplotlib")
    steps = [{"step": i, "reward": 0.5 + 0.1 * i, "reward_std": 0.2, "rewards/exact_match/mean": 0.1 * i,
              "rewards/format/mean": 0.5} for i in range(1, 6)]
    curve_path = tmp_path / "curve.json"
    curve_path.write_text(json.dumps({"model": "a test", "held_out_accuracy": {"before": 0.3, "after": 0.6},
                                      "steps": steps}))
    png = tmp_path / "figures" / "curve.png"
    assert example.main(["--plot", str(curve_path), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["curve.png"]

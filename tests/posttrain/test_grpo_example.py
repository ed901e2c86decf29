"""examples/grpo.py's quick path: a few SFT steps, a checkpoint, a few GRPO steps from it, and the
held-out accuracy read before and after (the full run, minutes on a CPU, is not part of the suite)."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def test_the_grpo_example_runs_its_quick_path(capsys):
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--quick"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "held-out accuracy" in line]
    assert len(lines) == 2 and lines[1].startswith("after GRPO")

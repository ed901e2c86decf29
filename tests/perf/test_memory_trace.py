"""bench/memory_trace.py: replaying an allocator trace finds the step's peak and who holds it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from memory_trace import MARKER_FUNCTION, label, peak_breakdown  # noqa: E402

GIB = 2**30


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


WEIGHTS = [frame("/x/torch/nn/modules/linear.py", 10, "__init__"), frame("/repo/tessera/models/gpt.py", 42, "build")]
ACTIVATION = [frame("/tmp/torchinductor/ab.py", 5, "call"), frame("/repo/tessera/models/transformer.py", 7, "forward")]
MARKER = [frame("/repo/bench/memory_trace.py", 20, MARKER_FUNCTION)]


def alloc(addr, gib, frames):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": frames}


def free(addr, gib):
    return [{"action": "free_requested", "addr": addr, "size": int(gib * GIB)},
            {"action": "free_completed", "addr": addr, "size": int(gib * GIB)}]


def step(base_addr, activation_gib):
    """A marker, two activations alive together, then freed."""
    return [alloc(base_addr, 0, MARKER), *free(base_addr, 0),
            alloc(base_addr + 1, activation_gib, ACTIVATION), alloc(base_addr + 2, activation_gib, ACTIVATION),
            *free(base_addr + 1, activation_gib), *free(base_addr + 2, activation_gib)]


def test_peak_of_the_last_marked_step_grouped_by_project_line():
    # The first step peaks higher (say, compilation): only the last one counts.
    trace = [alloc(1, 4.0, WEIGHTS)] + step(100, 3.0) + step(200, 1.5) + [alloc(300, 0.25, [])]
    result = peak_breakdown(trace)
    assert result["steps_marked"] == 2
    assert abs(result["peak_gib"] - 7.0) < 1e-6          # weights 4 + two activations of 1.5
    assert abs(result["before_step_gib"] - 4.0) < 1e-6
    groups = {g["where"]: (round(g["gib"], 6), g["blocks"]) for g in result["groups"]}
    assert groups == {"tessera/models/gpt.py:42 build": (4.0, 1),
                      "tessera/models/transformer.py:7 forward": (3.0, 2)}


def test_a_free_request_alone_keeps_the_block_alive():
    # Freed on another stream: the block is only reusable once the free completes.
    trace = [alloc(1, 1.0, WEIGHTS), {"action": "free_requested", "addr": 1, "size": GIB}, alloc(2, 1.0, WEIGHTS)]
    assert abs(peak_breakdown(trace)["peak_gib"] - 2.0) < 1e-6


def test_labels_fall_back_to_the_innermost_frame():
    assert label({"frames": ACTIVATION}) == "tessera/models/transformer.py:7 forward"
    assert label({"frames": ACTIVATION[:1]}) == "(no project frame) ab.py:5 call"
    assert label({"frames": []}).startswith("(no Python stack")

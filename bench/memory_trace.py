"""What fills the GPU at the peak of a training step: replay the CUDA caching allocator's trace.

`torch.cuda.memory._record_memory_history(stacks="python")` logs every allocation and
free with the Python stack that made it; `torch.cuda.memory._snapshot()` returns that log.
Replaying it gives the bytes alive at any moment, so at the step's peak each live block
can be charged to the line of tessera that allocated it (weights, gradient buckets,
optimizer state, saved activations, communication staging...). bench/train_mfu.py
--memory-trace uses this to show what the planner's memory model (tessera/perf/memory.py)
should count, instead of guessing from one peak number.

Steps are told apart by a marker: the bench allocates a small tensor in `step_marker()`
before each step, and the replay looks only at events after the last marker.
"""

from __future__ import annotations

from collections import Counter, defaultdict

MARKER_FUNCTION = "step_marker"
GIB = 2**30


def step_marker(device) -> None:
    """Allocate and drop a tiny tensor: a recognisable event in the allocator's trace."""
    import torch

    torch.empty(1, device=device)


def _is_marker(event: dict) -> bool:
    return event["action"] == "alloc" and any(f.get("name") == MARKER_FUNCTION for f in event.get("frames", ()))


def _replay(trace: list[dict], stop: int | None = None):
    """Live blocks (addr -> alloc event) and their byte total after events[:stop]; also the
    running total after each event."""
    live: dict[int, dict] = {}
    total, totals = 0, []
    for event in trace[:stop]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        totals.append(total)
    return live, total, totals


def label(event: dict, roots: tuple[str, ...] = ("tessera/", "bench/")) -> str:
    """The innermost frame in this project's code ('file:line function'); else the innermost frame."""
    frames = event.get("frames") or []
    for frame in frames:
        name = frame.get("filename", "")
        for root in roots:
            if root in name:
                return f"{root}{name.split(root, 1)[1]}:{frame.get('line')} {frame.get('name')}"
    if frames:
        return f"(no project frame) {_innermost(event)}"
    return "(no Python stack: autograd engine or C++)"


def _innermost(event: dict) -> str:
    frames = event.get("frames") or [{}]
    return f"{frames[0].get('filename', '?').rsplit('/', 1)[-1]}:{frames[0].get('line')} {frames[0].get('name')}"


def peak_breakdown(trace: list[dict], top: int = 30) -> dict:
    """Bytes alive at the highest point after the last step marker, grouped by allocating line."""
    markers = [i for i, event in enumerate(trace) if _is_marker(event)]
    start = markers[-1] if markers else 0
    _, _, totals = _replay(trace)
    if not totals:
        return {"peak_gib": 0.0, "groups": [], "events": 0}
    peak_index = max(range(start, len(totals)), key=totals.__getitem__)
    live, total, _ = _replay(trace, peak_index + 1)
    groups: dict[str, list] = defaultdict(lambda: [0, 0, Counter()])
    for event in live.values():
        entry = groups[label(event)]
        entry[0] += event["size"]
        entry[1] += 1
        entry[2][(_innermost(event), event["size"])] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_gib": total / GIB,
        "before_step_gib": totals[start] / GIB,
        "events": len(trace), "steps_marked": len(markers),
        "groups": [{"where": where, "gib": size / GIB, "blocks": count,
                    "largest": [f"{n} x {nbytes / 2**20:.1f} MiB from {frame}"
                                for (frame, nbytes), n in sorted(blocks.items(), key=lambda kv: -kv[0][1] * kv[1])[:4]]}
                   for where, (size, count, blocks) in ranked[:top]],
        "other_gib": sum(size for _, (size, _, _) in ranked[top:]) / GIB,
    }


def format_breakdown(result: dict) -> str:
    lines = [f"peak {result['peak_gib']:.2f} GiB in the last marked step "
             f"({result['before_step_gib']:.2f} GiB alive before it; {result['events']} trace events)"]
    for group in result["groups"]:
        lines.append(f"  {group['gib']:7.3f} GiB  x{group['blocks']:<5d} {group['where']}")
        lines += [f"{'':24}{largest}" for largest in group["largest"] if group["gib"] > 0.05]
    lines.append(f"  {result['other_gib']:7.3f} GiB  elsewhere")
    return "\n".join(lines)

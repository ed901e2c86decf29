"""Scaling figures in the style of Megatron's README: aggregate PFLOP/s against GPUs, log-log,
with the perfect-linear-scaling line, published points beside the predicted ones; and GRPO's
reward curve (examples/grpo.py --curve).

matplotlib is imported here only (the `plot` extra), so the planner runs without it.
"""

from __future__ import annotations

import os
from pathlib import Path

from tessera.perf.published import PublishedRun
from tessera.perf.simulator import Prediction

PEAK_TFLOPS = 989.0  # H100 and H200 dense bf16: the MFU's denominator here


def _aggregate_pflops(mfu: float, gpus: int) -> float:
    return mfu * PEAK_TFLOPS * gpus / 1e3


def scaling_figure(results: list[tuple[PublishedRun, Prediction]], title: str, path: str | Path,
                   label_points: str) -> Path:
    """Megatron's published runs beside the planner's predictions; `label_points` is 'model'
    (weak scaling) or 'mfu' (strong scaling)."""
    figure, axes = _axes()
    gpus = [run.gpus for run, _ in results]
    predicted = [_aggregate_pflops(p.mfu, run.gpus) for run, p in results]
    _perfect_line(axes, gpus, predicted[0])
    axes.plot(gpus, predicted, "o-", color="tab:blue", label="tessera plan (predicted)")
    published = [(run.gpus, _aggregate_pflops(run.mfu, run.gpus)) for run, _ in results if run.mfu is not None]
    axes.plot(*zip(*published), "s", color="tab:orange", markersize=8, label="Megatron-Core r0.8.0 (published)")
    for (run, prediction), y in zip(results, predicted):
        text = run.label if label_points == "model" else f"{prediction.mfu * 100:.1f}%"
        if run.mfu is not None:
            text += f"\n(pub. {run.mfu * 100:.0f}%)" if label_points == "mfu" else \
                f" {prediction.mfu * 100:.0f}% / {run.mfu * 100:.0f}%"
        axes.annotate(text, (run.gpus, y), textcoords="offset points", xytext=(6, -14), fontsize=7)
    return _save(figure, axes, title, "GPUs (H100)", path)


def measured_scaling_figure(points: list[dict], title: str, path: str | Path, label_points: str) -> Path:
    """tessera's measured ladder beside the planner's prediction of each point (bench/scaling.py's
    points: gpus, model, measured and predicted MFU); a point not measured shows its prediction only."""
    figure, axes = _axes()
    measured = [(p["gpus"], _aggregate_pflops(p["measured"]["mfu"], p["gpus"])) for p in points if p["measured"]]
    predicted = [(p["gpus"], _aggregate_pflops(p["predicted"]["mfu"], p["gpus"])) for p in points]
    first = measured[0] if measured else predicted[0]
    _perfect_line(axes, [first[0], points[-1]["gpus"]], first[1])
    if measured:
        axes.plot(*zip(*measured), "o-", color="tab:blue", label="tessera (measured)")
    axes.plot(*zip(*predicted), "s", color="tab:orange", markersize=7, fillstyle="none",
              label="tessera plan (predicted)")
    for point, (gpus, y) in zip(points, predicted):
        mfu = (f"{point['measured']['mfu'] * 100:.1f}% / " if point["measured"] else "") + \
            f"{point['predicted']['mfu'] * 100:.1f}% pred."
        text = f"{point['model']}\n{mfu}" if label_points == "model" else mfu
        axes.annotate(text, (gpus, y), textcoords="offset points", xytext=(6, -16), fontsize=7)
    return _save(figure, axes, title, "GPUs (H200)", path, ticks=[p["gpus"] for p in points])


def grpo_reward_figure(curve: dict, title: str, path: str | Path) -> Path:
    """The mean reward of each GRPO step's sampled answers and each reward's part of it (faint per
    step, solid as a moving mean over a twentieth of the run), with the held-out greedy accuracy
    before and after: examples/grpo.py's --curve JSON ("steps": the trainer's metrics by name)."""
    from matplotlib.ticker import MaxNLocator

    figure, axes = _axes()
    steps = curve["steps"]
    x = [s["step"] for s in steps]
    window = max(1, len(steps) // 20)
    names = ["reward"] + [n for n in steps[0] if n.startswith("rewards/")]
    for index, name in enumerate(names):
        values = [s[name] for s in steps]
        label = "reward (the sum): mean over each step's sampled answers" if name == "reward" else name.split("/")[1]
        axes.plot(x, values, color=f"C{index}", alpha=0.25, linewidth=0.8)
        axes.plot(x, _moving_mean(values, window), color=f"C{index}", linewidth=2 if name == "reward" else 1.2,
                  label=label)
    accuracy = curve["held_out_accuracy"]
    axes.plot([0, x[-1]], [accuracy["before"], accuracy["after"]], "o", color="black", markersize=7,
              label="held-out accuracy (greedy answers)")
    for step, value, when in ((0, accuracy["before"], "after SFT"), (x[-1], accuracy["after"], "after GRPO")):
        axes.annotate(f"{value:.0%} {when}", (step, value), textcoords="offset points", xytext=(6, 8), fontsize=8,
                      ha="right" if step else "left")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylim(bottom=0)
    axes.set_xlabel("GRPO step" + (f" (faint: each step; solid: {window}-step moving mean)" if window > 1 else ""))
    axes.set_ylabel("reward / fraction of answers right")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=1)
    return _save_whole(figure, path)


def _moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the window - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def _save_whole(figure, path: str | Path) -> Path:
    """Written under a temporary name, then renamed: a reader never sees half a PNG."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp.png")
    figure.savefig(partial, bbox_inches="tight")
    plt.close(figure)
    os.replace(partial, path)
    return path


def _axes():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7.5, 5.2), dpi=120)


def _perfect_line(axes, gpus: list[int], first_pflops: float) -> None:
    """Perfect linear scaling from the first point."""
    axes.plot([gpus[0], gpus[-1]], [first_pflops, first_pflops * gpus[-1] / gpus[0]], "--", color="gray",
              label="perfect linear scaling")


def _save(figure, axes, title: str, xlabel: str, path: str | Path, ticks: list[int] | None = None) -> Path:
    """Log-log axes, labelled; `ticks`: GPU counts to mark with plain numbers (a single host's few)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    axes.set_xscale("log")
    axes.set_yscale("log")
    if ticks:
        axes.set_xticks(ticks, [str(t) for t in ticks])
        axes.xaxis.set_minor_formatter(NullFormatter())
        for formatter in (axes.yaxis.set_major_formatter, axes.yaxis.set_minor_formatter):
            formatter(ScalarFormatter())
    axes.set_xlabel(xlabel)
    axes.set_ylabel("aggregate throughput (PFLOP/s)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path

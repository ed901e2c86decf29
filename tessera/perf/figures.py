"""Scaling figures in the style of Megatron's README: aggregate PFLOP/s against GPUs, log-log,
with the perfect-linear-scaling line, published points beside the predicted ones.

matplotlib is imported here only (the `plot` extra), so the planner runs without it.
"""

from __future__ import annotations

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

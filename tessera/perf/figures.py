"""Scaling figures in the style of Megatron's README: aggregate PFLOP/s against GPUs, log-log,
with the perfect-linear-scaling line, published points beside the predicted ones.

matplotlib is imported here only (the `plot` extra), so the planner runs without it.
"""

from __future__ import annotations

from pathlib import Path

from tessera.perf.published import PublishedRun
from tessera.perf.simulator import Prediction

PEAK_TFLOPS = 989.0  # H100 dense bf16, the published MFU's denominator


def _aggregate_pflops(mfu: float, gpus: int) -> float:
    return mfu * PEAK_TFLOPS * gpus / 1e3


def scaling_figure(results: list[tuple[PublishedRun, Prediction]], title: str, path: str | Path,
                   label_points: str) -> Path:
    """Draw one figure; `label_points` is 'model' (weak scaling) or 'mfu' (strong scaling)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = [run.gpus for run, _ in results]
    predicted = [_aggregate_pflops(p.mfu, run.gpus) for run, p in results]
    figure, axes = plt.subplots(figsize=(7.5, 5.2), dpi=120)
    # Perfect linear scaling from the first predicted point.
    axes.plot([gpus[0], gpus[-1]], [predicted[0], predicted[0] * gpus[-1] / gpus[0]], "--", color="gray",
              label="perfect linear scaling")
    axes.plot(gpus, predicted, "o-", color="tab:blue", label="tessera plan (predicted)")
    published = [(run.gpus, _aggregate_pflops(run.mfu, run.gpus)) for run, _ in results if run.mfu is not None]
    axes.plot(*zip(*published), "s", color="tab:orange", markersize=8, label="Megatron-Core r0.8.0 (published)")
    for (run, prediction), y in zip(results, predicted):
        text = run.label if label_points == "model" else f"{prediction.mfu * 100:.1f}%"
        if run.mfu is not None:
            text += f"\n(pub. {run.mfu * 100:.0f}%)" if label_points == "mfu" else \
                f" {prediction.mfu * 100:.0f}% / {run.mfu * 100:.0f}%"
        axes.annotate(text, (run.gpus, y), textcoords="offset points", xytext=(6, -14), fontsize=7)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("GPUs (H100)")
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

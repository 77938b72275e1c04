"""Loss-curve figures for a training run and for a comparison of regimes (matplotlib, Agg)."""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple

from .run_directory import atomic_write

__all__ = ["plot_run", "plot_compare"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError("plots need matplotlib: pip install matplotlib") from error
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def _finite(points: Sequence[Tuple[int, float]]) -> List[Tuple[int, float]]:
    return [(s, v) for s, v in points if math.isfinite(v)]


def plot_run(metrics_csv: Path, out: Path, baseline: Optional[float], title: str = "") -> Path:
    """Training loss (every step) and validation loss (evaluation steps) against ``baseline``."""
    train: List[Tuple[int, float]] = []
    val: List[Tuple[int, float]] = []
    with open(metrics_csv, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            step = int(row["step"])
            train.append((step, float(row["train_loss"])))
            if row["val_loss"]:
                val.append((step, float(row["val_loss"])))
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    if train:
        steps, losses = zip(*_finite(train)) if _finite(train) else ((), ())
        axes.plot(steps, losses, color="tab:blue", alpha=0.5, linewidth=0.8, label="train")
    if _finite(val):
        steps, losses = zip(*_finite(val))
        axes.plot(steps, losses, "o-", color="tab:orange", label="validation")
    if baseline is not None:
        axes.axhline(baseline, color="gray", linestyle="--", label=f"unigram {baseline:.3f}")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per character)")
    _short_tick_labels(axes)
    axes.set_title(title)
    axes.legend()
    axes.grid(alpha=0.3)
    # Fixed margins: tight_layout costs more than drawing the figure.
    figure.subplots_adjust(left=0.11, right=0.97, bottom=0.12, top=0.92)
    _save(plt, figure, Path(out))
    return Path(out)


def plot_compare(
    curves: Mapping[str, Sequence[Tuple[int, float]]], out: Path, baseline: Optional[float],
    title: str = "Validation loss by regime",
) -> Path:
    """One validation-loss curve per regime; a diverged regime shows up to its last finite point."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    for regime, points in curves.items():
        finite = _finite(points)
        style = "--" if regime.startswith("unit-") else "-"
        if finite:
            steps, losses = zip(*finite)
            axes.plot(steps, losses, style, marker="o", markersize=3, label=regime)
        else:
            axes.plot([], [], style, label=f"{regime} (no finite loss)")
    if baseline is not None:
        axes.axhline(baseline, color="gray", linestyle=":", label=f"unigram {baseline:.3f}")
    axes.set_xlabel("step")
    axes.set_ylabel("validation cross-entropy (nats per character)")
    _short_tick_labels(axes)
    axes.set_title(title)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    # Fixed margins: tight_layout costs more than drawing the figure.
    figure.subplots_adjust(left=0.11, right=0.97, bottom=0.12, top=0.92)
    _save(plt, figure, Path(out))
    return Path(out)


def _short_tick_labels(axes: Any) -> None:
    # The fixed left margin holds tick labels of four digits; larger losses (a run diverging)
    # get a power-of-ten offset instead of labels that would push the axis label off the figure.
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))


def _save(plt: Any, figure: Any, out: Path) -> None:
    # Whole or not at all, like every file of a run directory.
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, dpi=100, format="png")
    finally:
        plt.close(figure)
    atomic_write(out, buffer.getvalue())

"""Loss-curve figures for a training run and for a comparison of regimes (matplotlib, Agg)."""
from __future__ import annotations

import csv
import errno
import io
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .run_directory import RunError, atomic_write

__all__ = ["plot_run", "plot_compare", "curve_styles"]


def load_pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only); RuntimeError if it is missing."""
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
    plt = load_pyplot()
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
    save_figure(plt, figure, Path(out))
    return Path(out)


# One look per regime: the colour says the precision, the line style (and marker) the model.
# Twelve regimes, twelve looks; names that are not regimes take the looks left over.
_PRECISION_COLOURS = {("fp32", ""): "tab:blue", ("fp16", ""): "tab:orange",
                      ("fp8", "static"): "tab:green", ("fp8", "amax"): "tab:red"}
_KIND_LINES = {"plain": ("-", "o"), "unit": ("--", "s"), "u-mup": (":", "^")}
_SPARE_COLOURS = ("tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan",
                  "tab:blue", "tab:orange", "tab:green", "tab:red")
_SPARE_LINES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def curve_styles(names: Sequence[str]) -> Dict[str, Dict[str, str]]:
    """A distinct matplotlib style (``color``, ``linestyle``, ``marker``) for each name.

    A comparison regime (``fp32``, ``unit-fp8``, ``umup-fp8-amax``, ...) is coloured by its
    precision and drawn in its model's line style, so that the same regime looks the same in
    every figure; other names get the pairs of colour and line style no name has yet.
    """
    from .precision import REGIME_SETTINGS

    styles: Dict[str, Dict[str, str]] = {}
    used = set()
    for name in names:
        if name in REGIME_SETTINGS:
            kind, dtype, scaling = REGIME_SETTINGS[name]
            colour = _PRECISION_COLOURS[(dtype, scaling if dtype == "fp8" else "")]
            linestyle, marker = _KIND_LINES[kind]
            styles[name] = {"color": colour, "linestyle": linestyle, "marker": marker}
            used.add((colour, linestyle))
    spare = [(colour, line) for line in _SPARE_LINES for colour in _SPARE_COLOURS]
    for name in names:
        if name in styles:
            continue
        colour, (linestyle, marker) = next(
            (c, l) for c, l in spare if (c, l[0]) not in used)  # noqa: E741
        used.add((colour, linestyle))
        styles[name] = {"color": colour, "linestyle": linestyle, "marker": marker}
    return styles


Curve = Sequence[Tuple[Any, ...]]  # (step, loss) or (step, mean, std) points


def plot_compare(
    curves: Mapping[str, Curve], out: Path, baseline: Optional[float],
    title: str = "Validation loss by regime", labels: Optional[Mapping[str, str]] = None,
    ylabel: str = "validation cross-entropy (nats per character)",
) -> Path:
    """One validation-loss curve per regime, each in its own :func:`curve_styles` look, the
    legend beside the plot; a diverged regime shows up to its last finite point.

    A point may be ``(step, loss)`` or ``(step, mean, std)``: a mean over seeds, drawn with a
    band of +-1 std. When no regime has more than one point (runs evaluated only at their end),
    each regime is one marker at its final loss, with a +-1 std bar, side by side.
    ``labels`` replaces a regime's name in the legend (e.g. to add a note to it).
    """
    plt = load_pyplot()
    labels = dict(labels or {})
    styles = curve_styles(list(curves))
    finite = {regime: [p for p in points if math.isfinite(p[1])]
              for regime, points in curves.items()}
    figure, axes = plt.subplots(figsize=(10, 5))
    single = all(len(points) <= 1 for points in finite.values())
    if single:
        _plot_final_points(axes, finite, styles, labels)
    else:
        for regime, points in finite.items():
            style = styles[regime]
            label = labels.get(regime, regime)
            if not points:
                axes.plot([], [], linestyle=style["linestyle"], color=style["color"],
                          label=f"{label} (no finite loss)")
                continue
            steps = [p[0] for p in points]
            losses = [p[1] for p in points]
            axes.plot(steps, losses, markersize=3, label=label, **style)
            spread = [p[2] if len(p) > 2 else 0.0 for p in points]
            if any(spread):
                axes.fill_between(steps, [m - s for m, s in zip(losses, spread)],
                                  [m + s for m, s in zip(losses, spread)],
                                  color=style["color"], alpha=0.15, linewidth=0)
        axes.set_xlabel("step")
    if baseline is not None:
        axes.axhline(baseline, color="gray", linestyle=(0, (1, 3)),
                     label=f"unigram {baseline:.3f}")
    axes.set_ylabel(ylabel)
    _short_tick_labels(axes)
    axes.set_title(title)
    # Beside the plot, never over a curve.
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axes.grid(alpha=0.3)
    # Fixed margins (tight_layout costs more than drawing the figure); the right for the legend.
    figure.subplots_adjust(left=0.09, right=0.75, bottom=0.25 if single else 0.12, top=0.92)
    save_figure(plt, figure, Path(out))
    return Path(out)


def _plot_final_points(axes: Any, finite: Mapping[str, Curve],
                       styles: Mapping[str, Mapping[str, str]],
                       labels: Mapping[str, str]) -> None:
    """Each regime's only point as a marker (with its +-1 std bar) at its own x position."""
    names = list(finite)
    steps = sorted({p[0] for points in finite.values() for p in points})
    for index, regime in enumerate(names):
        style = styles[regime]
        label = labels.get(regime, regime)
        if not finite[regime]:
            axes.plot([], [], linestyle="none", marker=style["marker"], color=style["color"],
                      label=f"{label} (no finite loss)")
            continue
        point = finite[regime][0]
        spread = point[2] if len(point) > 2 else 0.0
        axes.errorbar([index], [point[1]], yerr=[spread] if spread else None,
                      marker=style["marker"], markersize=8, color=style["color"],
                      linestyle="none", capsize=4, label=label)
    axes.set_xticks(range(len(names)))
    axes.set_xticklabels([labels.get(n, n) for n in names], rotation=30, ha="right",
                         fontsize=8)
    axes.set_xlim(-0.6, len(names) - 0.4)
    shown = ", ".join(str(s) for s in steps)
    axes.set_xlabel(f"regime (one evaluation per run, at step {shown})")


def _short_tick_labels(axes: Any) -> None:
    # The fixed left margin holds tick labels of four digits; larger losses (a run diverging)
    # get a power-of-ten offset instead of labels that would push the axis label off the figure.
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))


def save_figure(plt: Any, figure: Any, out: Path) -> None:
    """Write ``figure`` to ``out`` whole or not at all, and close it."""
    # Whole or not at all, like every file of a run directory.
    buffer = io.BytesIO()
    try:
        figure.savefig(buffer, dpi=100, format="png")
    finally:
        plt.close(figure)
    try:
        if out.is_dir():  # os.replace would name its temporary file, not the figure
            raise IsADirectoryError(errno.EISDIR, "it is a directory", str(out))
        atomic_write(out, buffer.getvalue())
    except OSError as error:
        reason = "it is a directory" if isinstance(error, IsADirectoryError) else \
            error.strerror or str(error)
        raise RunError(f"{out.name} not written: cannot replace {out}: {reason} (the other "
                       f"files in {out.parent} are written)") from None

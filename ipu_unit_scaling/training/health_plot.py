"""``health.png``: a run's telemetry at a glance, read from its ``telemetry.csv``.

Four panels over the sampled steps: sites x steps heat maps of the flushed and of the
saturated fraction (one row per cast site, darker is worse, on a log scale from 0.01% to 100%);
the scaling-bias tracks of every site; and where each site's scaled RMS sits in its format
(``log2(rms * 2**bias)``, against the largest value and the smallest normal of F143 and
F152), coloured by role. Warnings are marked on the heat maps where they were raised.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Sequence

from ..fp8.fp8_formats import F143, F152
from .plots import load_pyplot, save_figure
from .telemetry_log import read_telemetry

__all__ = ["plot_health"]

_ROLE_COLOURS = {"activation": "tab:blue", "weight": "tab:green", "gradient": "tab:red"}
_FLOOR = 1e-4  # fractions below 0.01% are drawn as 0.01%: the colour scale is logarithmic


def plot_health(telemetry_csv: Path, out: Path, title: str = "") -> Path:
    """Draw ``out`` from ``telemetry_csv``; TelemetryFileError for a damaged file,
    RuntimeError without matplotlib or without cast rows to draw."""
    rows = read_telemetry(telemetry_csv)
    casts = [r for r in rows if r["kind"] == "cast"]
    if not casts:
        raise RuntimeError(f"{telemetry_csv} has no cast rows to draw")
    sites: List[str] = []
    for row in casts:
        if row["site"] not in sites:
            sites.append(row["site"])
    steps = sorted({r["step"] for r in casts})
    column = {step: i for i, step in enumerate(steps)}
    line = {site: i for i, site in enumerate(sites)}
    flushed = [[math.nan] * len(steps) for _ in sites]
    saturated = [[math.nan] * len(steps) for _ in sites]
    biases: Dict[str, List[Any]] = {site: [] for site in sites}
    levels: Dict[str, List[Any]] = {site: [] for site in sites}
    roles: Dict[str, str] = {}
    for row in casts:
        i, j = line[row["site"]], column[row["step"]]
        flushed[i][j] = max(row["flushed_fraction"], _FLOOR)
        saturated[i][j] = max(row["saturated_fraction"], _FLOOR)
        biases[row["site"]].append((row["step"], row["log2_scale"]))
        if row["rms"] > 0:
            levels[row["site"]].append((row["step"], math.log2(row["rms"]) + row["log2_scale"]))
        roles[row["site"]] = row["role"]
    warned = [r for r in rows if r["kind"] == "warning" and r["site"] in line]

    plt = load_pyplot()
    from matplotlib.colors import LogNorm

    height = max(4.0, 0.16 * len(sites) + 1.5)
    figure, axes = plt.subplots(1, 4, figsize=(22, height))
    norm = LogNorm(vmin=_FLOOR, vmax=1.0)
    for ax, values, name, kind in ((axes[0], flushed, "flushed fraction", "flushed"),
                                   (axes[1], saturated, "saturated fraction", "saturated")):
        image = ax.imshow(values, aspect="auto", cmap="magma_r", norm=norm,
                          interpolation="nearest")
        ax.set_title(name)
        ax.set_xlabel("sampled step")
        _step_ticks(ax, steps)
        ax.set_yticks(range(len(sites)))
        ax.set_yticklabels(sites if ax is axes[0] else [], fontsize=6)
        for w in warned:
            if w["role"] == kind and w["step"] in column:
                ax.plot(column[w["step"]], line[w["site"]], "c*", markersize=7)
        figure.colorbar(image, ax=ax, fraction=0.05, pad=0.02)
    for ax, tracks, name in ((axes[2], biases, "scaling bias (log2 scale)"),
                             (axes[3], levels, "log2 of the scaled RMS")):
        for site, points in tracks.items():
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, "-", color=_ROLE_COLOURS.get(roles[site], "gray"), alpha=0.6,
                        linewidth=1)
        ax.set_title(name + " per site")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for role, colour in _ROLE_COLOURS.items():
        axes[2].plot([], [], color=colour, label=role)
    axes[2].legend(fontsize=8)
    for fmt, style in ((F143, "--"), (F152, ":")):
        axes[3].axhline(math.log2(fmt.max), color="black", linestyle=style, linewidth=0.8,
                        label=f"{fmt.name} max, smallest normal")
        axes[3].axhline(1 - fmt.bias, color="black", linestyle=style, linewidth=0.8)
    axes[3].legend(fontsize=8)
    figure.suptitle(title or "run health: * marks a warning")
    figure.subplots_adjust(left=0.13, right=0.98, bottom=0.1, top=0.9, wspace=0.3)
    save_figure(plt, figure, Path(out))
    return Path(out)


def _step_ticks(ax: Any, steps: Sequence[int]) -> None:
    every = max(1, len(steps) // 8)
    ax.set_xticks(range(0, len(steps), every))
    ax.set_xticklabels([str(steps[i]) for i in range(0, len(steps), every)], fontsize=7)

"""Experiments made of many runs: ``compare`` over seeds (sweeps are :mod:`.sweep`).

- :func:`aggregate_seeds` turns one ``compare`` per seed into mean +- standard deviation of each
  regime's final validation loss and of its gap to ``fp32`` (paired by seed: every regime of a
  seed trains on the same batches from the same seed), and draws the mean validation curves with
  +-1 std bands.
- :func:`run_sweep` trains a grid of learning rates (powers of two) x widths (x depths) for one
  or more model kinds (``plain``, ``unit``, ``u-mup``) and writes a table and the μP-style
  transfer plot: final validation loss against the learning rate, one curve per width. If a
  parametrization transfers, the best learning rate stays put as the width grows. Given a
  config key and its values (:func:`parse_sweep_values`), it sweeps that key instead, each
  model at its default learning rate, and reports whether the best value stays put.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    pass

__all__ = [
    "SeedSummary",
    "aggregate_seeds",
    "format_seed_table",
    "write_seed_results",
]

# The fp32 regime of each model kind: its learning rate is the kind's default.
DEFAULT_REGIME = {"plain": "fp32", "unit": "unit-fp32", "u-mup": "umup-fp32"}

# u-μP's regimes run at its defaults (eta = 1, every multiplier 1), which the sweeps recorded
# in docs/results found far from this model's best: the table and figure say so.
UNTUNED_MARK = "(untuned defaults)"
UNTUNED_NOTE = (
    "u-μP regimes marked (untuned defaults) ran with u-μP's default hyperparameters "
    "(learning rate 1, every multiplier 1), not values tuned for the model: on the default "
    "model (width 128, depth 2, 500 steps) the recorded sweeps (docs/results/"
    "residual-mult-sweep, docs/results/lr-sweep) found model.residual_mult 0.125 and "
    "learning rate 0.5 better. Their gap is not u-μP's verdict; see docs/guide/compare.md."
)


def _mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (n - 1); None where there are too few values."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else None


def read_json_or_empty(path: Path) -> Dict[str, Any]:
    """The JSON mapping at ``path``, or an empty one where there is none."""
    from ..training.run_directory import read_json

    # (a FIFO or a device in a point's place is never read: it reads as no summary)
    return read_json(path) or {}


# ----------------------------------------------------------------------- compare over seeds


@dataclass
class SeedSummary:
    """One regime over several seeds."""

    regime: str
    model: str
    precision: str
    learning_rate: float
    seeds: List[int]
    losses: List[Optional[float]]  # final validation loss per seed; None: did not complete
    mean: Optional[float]
    std: Optional[float]
    gap_mean: Optional[float]  # percent, the mean of the per-seed gaps to fp32
    gap_std: Optional[float]
    elapsed_s: float
    untuned: bool = False  # a u-μP regime at u-μP's default hyperparameters (compare.untuned)

    @property
    def failed(self) -> int:
        return sum(loss is None for loss in self.losses)


def aggregate_seeds(
    per_seed: Mapping[int, Sequence[Mapping[str, Any]]], reference: str = "fp32"
) -> List[SeedSummary]:
    """Summaries of the rows ``compare`` returned for each seed (seed -> rows, one per regime).

    The gap of a regime to ``reference`` is taken seed by seed, then averaged, so that what
    the seeds share (data order, initial weights) cancels; a seed whose reference did not
    complete gives no gap.
    """
    seeds = sorted(per_seed)
    regimes = [row["regime"] for row in per_seed[seeds[0]]]
    by_seed = {seed: {row["regime"]: row for row in rows} for seed, rows in per_seed.items()}
    summaries = []
    for regime in regimes:
        rows = [by_seed[seed][regime] for seed in seeds]
        losses = [row.get("final_val_loss") for row in rows]
        gaps = []
        for seed, loss in zip(seeds, losses):
            base = by_seed[seed].get(reference, {}).get("final_val_loss")
            if loss is not None and base:
                gaps.append(100.0 * (loss - base) / base)
        mean, std = _mean_std([loss for loss in losses if loss is not None])
        gap_mean, gap_std = _mean_std(gaps)
        summaries.append(SeedSummary(
            regime=regime, model=rows[0]["model"], precision=rows[0]["precision"],
            learning_rate=rows[0]["learning_rate"], seeds=seeds, losses=losses, mean=mean,
            std=std, gap_mean=gap_mean, gap_std=gap_std,
            elapsed_s=sum(row.get("elapsed_s") or 0.0 for row in rows),
            untuned=bool(rows[0].get("untuned")),
        ))
    return summaries


def _pm(mean: Optional[float], std: Optional[float], digits: int, suffix: str = "",
        sign: bool = False) -> str:
    if mean is None:
        return "-"
    text = f"{mean:+.{digits}f}" if sign else f"{mean:.{digits}f}"
    return text + suffix + ("" if std is None else f" ± {std:.{digits}f}{suffix}")


def format_seed_table(summaries: Sequence[SeedSummary], baseline: Optional[float]) -> str:
    """Markdown: mean ± std of the final validation loss and of the paired gap to fp32."""

    seeds = summaries[0].seeds if summaries else []
    lines = [
        f"| regime | model | precision | learning rate | final val loss (mean ± std, "
        f"{len(seeds)} seeds) | gap to fp32 (mean ± std) | per seed | time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        per_seed = ", ".join("diverged" if loss is None else f"{loss:.4f}" for loss in s.losses)
        failed = f" ({s.failed} of {len(s.losses)} did not finish)" if s.failed else ""
        model = f"{s.model} {UNTUNED_MARK}" if s.untuned else s.model
        lines.append(
            f"| {s.regime} | {model} | {s.precision} | {s.learning_rate:g} | "
            f"{_pm(s.mean, s.std, 4)}{failed} | {_pm(s.gap_mean, s.gap_std, 2, '%', True)} | "
            f"{per_seed} | {s.elapsed_s:.0f} s |"
        )
    lines.append("")
    lines.append(f"Seeds {', '.join(map(str, seeds))}; std is the sample standard deviation "
                 "over seeds; each gap is taken seed by seed against that seed's fp32 run.")
    if baseline is not None:
        lines.append(f"Unigram baseline (validation): {baseline:.4f} nats per character.")
    if any(s.untuned for s in summaries):
        lines.append("")
        lines.append(UNTUNED_NOTE)
    return "\n".join(lines)


def mean_curves(
    curves: Mapping[int, Mapping[str, Sequence[Tuple[int, float]]]],
) -> Dict[str, List[Tuple[int, float, float]]]:
    """regime -> [(step, mean, sample std)] over the seeds that reached that step with a finite
    loss."""
    by_regime: Dict[str, Dict[int, List[float]]] = {}
    for seed_curves in curves.values():
        for regime, points in seed_curves.items():
            for step, loss in points:
                if math.isfinite(loss):
                    by_regime.setdefault(regime, {}).setdefault(int(step), []).append(loss)
    result = {}
    for regime, steps in by_regime.items():
        result[regime] = [(step, statistics.fmean(v), statistics.stdev(v) if len(v) > 1
                           else 0.0) for step, v in sorted(steps.items())]
    return result


def plot_seed_curves(curves: Mapping[str, Sequence[Tuple[int, float, float]]], out: Path,
                     baseline: Optional[float], seeds: int,
                     labels: Optional[Mapping[str, str]] = None) -> Path:
    """Mean validation curve of each regime with a +-1 std band over seeds."""
    from ..training.plots import plot_compare

    return plot_compare(curves, out, baseline,
                        title=f"Validation loss by regime: mean ± std over {seeds} seeds",
                        labels=labels)


def save_laid_out_figure(plt: Any, figure: Any, out: Path) -> None:
    """Lay ``figure`` out tight, then save it whole (``training.plots.save_figure``)."""
    from ..training.plots import save_figure as save_whole

    figure.tight_layout()
    save_whole(plt, figure, out)


def write_text_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` in UTF-8, whole or not at all."""
    from ..training.run_directory import atomic_write

    atomic_write(path, text.encode("utf-8"))


def write_seed_results(run_dir: Path, per_seed: Mapping[int, Sequence[Mapping[str, Any]]],
                       seed_dirs: Mapping[int, Path]) -> Tuple[List[SeedSummary], str]:
    """``compare.md``, ``compare.json`` and ``compare.png`` of a multi-seed compare."""
    summaries = aggregate_seeds(per_seed)
    baseline = None
    curves: Dict[int, Dict[str, List[Tuple[int, float]]]] = {}
    for seed, directory in seed_dirs.items():
        data = read_json_or_empty(directory / "compare.json")
        baseline = data.get("unigram_baseline", baseline)
        curves[seed] = {}
        for row in per_seed[seed]:
            summary = read_json_or_empty(directory / row["regime"] / "summary.json")
            curves[seed][row["regime"]] = [(int(s), float(v))
                                           for s, v in summary.get("val_curve", [])]
    table = format_seed_table(summaries, baseline)
    write_text_file(run_dir / "compare.md", table + "\n")
    payload = {"unigram_baseline": baseline, "seeds": sorted(per_seed),
               "regimes": [vars(s) for s in summaries]}
    write_text_file(run_dir / "compare.json", json.dumps(payload, indent=2))

    plot_seed_curves(mean_curves(curves), run_dir / "compare.png", baseline, len(per_seed),
                     labels={s.regime: f"{s.regime} {UNTUNED_MARK}" for s in summaries
                             if s.untuned})
    return summaries, table



"""Experiments made of many runs: ``compare`` over seeds, and learning-rate sweeps.

- :func:`aggregate_seeds` turns one ``compare`` per seed into mean +- standard deviation of each
  regime's final validation loss and of its gap to ``fp32`` (paired by seed: every regime of a
  seed trains on the same batches from the same seed), and draws the mean validation curves with
  +-1 std bands.
- :func:`run_sweep` trains a grid of learning rates (powers of two) x widths (x depths) for one
  or more model kinds (``plain``, ``unit``, ``u-mup``) and writes a table and the μP-style
  transfer plot: final validation loss against the learning rate, one curve per width. If a
  parametrization transfers, the best learning rate stays put as the width grows.
"""
from __future__ import annotations

import copy
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .config import Config

if TYPE_CHECKING:
    from .data import Corpus

__all__ = [
    "SeedSummary",
    "aggregate_seeds",
    "format_seed_table",
    "SweepPoint",
    "default_exponents",
    "run_sweep",
    "transfer_summary",
    "format_sweep_tables",
]

# The fp32 regime of each model kind: its learning rate is the kind's default.
DEFAULT_REGIME = {"plain": "fp32", "unit": "unit-fp32", "u-mup": "umup-fp32"}


def _mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """Mean and sample standard deviation (n - 1); None where there are too few values."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else None


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
        lines.append(
            f"| {s.regime} | {s.model} | {s.precision} | {s.learning_rate:g} | "
            f"{_pm(s.mean, s.std, 4)}{failed} | {_pm(s.gap_mean, s.gap_std, 2, '%', True)} | "
            f"{per_seed} | {s.elapsed_s:.0f} s |"
        )
    lines.append("")
    lines.append(f"Seeds {', '.join(map(str, seeds))}; std is the sample standard deviation "
                 "over seeds; each gap is taken seed by seed against that seed's fp32 run.")
    if baseline is not None:
        lines.append(f"Unigram baseline (validation): {baseline:.4f} nats per character.")
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
                     baseline: Optional[float], seeds: int) -> Path:
    """Mean validation curve of each regime with a +-1 std band over seeds."""
    from .plots import _pyplot

    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    for regime, points in curves.items():
        steps = [p[0] for p in points]
        mean = [p[1] for p in points]
        std = [p[2] for p in points]
        style = "--" if regime.startswith("unit-") else ":" if regime.startswith("umup-") else "-"
        (line,) = axes.plot(steps, mean, style, marker="o", markersize=3, label=regime)
        axes.fill_between(steps, [m - s for m, s in zip(mean, std)],
                          [m + s for m, s in zip(mean, std)], color=line.get_color(), alpha=0.2)
    if baseline is not None:
        axes.axhline(baseline, color="gray", linestyle=":", label=f"unigram {baseline:.3f}")
    axes.set_xlabel("step")
    axes.set_ylabel("validation cross-entropy (nats per character)")
    axes.set_title(f"Validation loss by regime: mean ± std over {seeds} seeds")
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    _save(plt, figure, out)
    return out


def _save(plt: Any, figure: Any, out: Path) -> None:
    from .plots import _save as save_whole

    figure.tight_layout()
    save_whole(plt, figure, out)


def _write_text(path: Path, text: str) -> None:
    from .rundir import atomic_write

    atomic_write(path, text.encode("utf-8"))


def write_seed_results(run_dir: Path, per_seed: Mapping[int, Sequence[Mapping[str, Any]]],
                       seed_dirs: Mapping[int, Path]) -> Tuple[List[SeedSummary], str]:
    """``compare.md``, ``compare.json`` and ``compare.png`` of a multi-seed compare."""
    summaries = aggregate_seeds(per_seed)
    baseline = None
    curves: Dict[int, Dict[str, List[Tuple[int, float]]]] = {}
    for seed, directory in seed_dirs.items():
        data = _read_json(directory / "compare.json")
        baseline = data.get("unigram_baseline", baseline)
        curves[seed] = {}
        for row in per_seed[seed]:
            summary = _read_json(directory / row["regime"] / "summary.json")
            curves[seed][row["regime"]] = [(int(s), float(v))
                                           for s, v in summary.get("val_curve", [])]
    table = format_seed_table(summaries, baseline)
    _write_text(run_dir / "compare.md", table + "\n")
    payload = {"unigram_baseline": baseline, "seeds": sorted(per_seed),
               "regimes": [vars(s) for s in summaries]}
    _write_text(run_dir / "compare.json", json.dumps(payload, indent=2))
    plot_seed_curves(mean_curves(curves), run_dir / "compare.png", baseline, len(per_seed))
    return summaries, table


# ------------------------------------------------------------------------------- sweeps


@dataclass
class SweepPoint:
    """One trained point of a sweep."""

    kind: str  # plain, unit or u-mup
    width: int
    depth: int
    log2_lr: int
    status: str  # completed, diverged, ...
    final_val_loss: Optional[float]
    elapsed_s: float

    @property
    def learning_rate(self) -> float:
        return 2.0**self.log2_lr


def default_exponents(config: Config, kind: str, span: int) -> List[int]:
    """Powers of two around the kind's default learning rate: ``round(log2 lr) +- span``."""
    centre = round(math.log2(config.compare.learning_rates[DEFAULT_REGIME[kind]]))
    return list(range(centre - span, centre + span + 1))


def point_config(config: Config, kind: str, width: int, depth: int, log2_lr: int) -> Config:
    from .train import set_model_kind

    cfg = copy.deepcopy(config)
    set_model_kind(cfg, kind)
    cfg.model.hidden_size = width
    cfg.model.depth = depth
    cfg.training.learning_rate = 2.0**log2_lr
    cfg.training.eval_interval = 0  # the final validation loss is what a sweep compares
    return cfg


def _point_dir(run_dir: Path, kind: str, width: int, depth: int, log2_lr: int) -> Path:
    return run_dir / kind / f"w{width}-d{depth}" / f"log2lr{log2_lr:+d}"


def run_sweep(
    config: Config,
    kinds: Sequence[str],
    widths: Sequence[int],
    depths: Sequence[int],
    exponents: Mapping[str, Sequence[int]],
    run_dir: Path,
    quiet: bool = False,
    log: Callable[[str], None] = print,
) -> List[SweepPoint]:
    """Train every (kind, depth, width, learning rate) into ``run_dir`` and write ``sweep.md``,
    ``sweep.json`` and ``sweep.png``. Finished points found in ``run_dir`` are reused,
    unfinished ones resumed; a point that diverges is recorded as such and the sweep goes on."""
    from .config import validate
    from .data import load_corpus
    from .rundir import RunLock, make_run_dir

    plan = [(kind, depth, width, e) for kind in kinds for depth in depths for width in widths
            for e in exponents[kind]]
    for kind, depth, width, log2_lr in plan:  # every point is checked before the first trains
        validate(point_config(config, kind, width, depth, log2_lr))
    make_run_dir(run_dir)
    with RunLock(run_dir):  # one sweep at a time in a directory
        corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
        points = _train_points(config, plan, run_dir, quiet, log, corpus)
        defaults = {kind: config.compare.learning_rates[DEFAULT_REGIME[kind]] for kind in kinds}
        tables = format_sweep_tables(points, defaults)
        _write_text(run_dir / "sweep.md", tables + "\n")
        _write_text(run_dir / "sweep.json", json.dumps({
            "points": [vars(p) for p in points], "default_learning_rates": defaults,
            "summary": transfer_summary(points, defaults)}, indent=2))
        plot_sweep(points, defaults, run_dir / "sweep.png")
    return points


def _train_points(config: Config, plan: Sequence[Tuple[str, int, int, int]], run_dir: Path,
                  quiet: bool, log: Callable[[str], None], corpus: Corpus) -> List[SweepPoint]:
    from .rundir import RunError
    from .train import TrainingDiverged, check_reused_tokenizer, train

    points: List[SweepPoint] = []
    for index, (kind, depth, width, log2_lr) in enumerate(plan, 1):
        directory = _point_dir(run_dir, kind, width, depth, log2_lr)
        summary = _read_json(directory / "summary.json")
        name = f"{kind} w{width} d{depth} lr 2^{log2_lr}"
        cfg = point_config(config, kind, width, depth, log2_lr)
        if summary or (directory / "checkpoint.pt").is_file():
            _check_same_settings(directory, cfg)
        if summary and summary.get("data_sha256") != corpus.sha256:
            raise RunError(f"{directory} was trained with other settings (data: {corpus.source} "
                           "is not the text it trained on); rerun with the same settings or "
                           "choose another --run-dir")
        if summary.get("status") in ("completed", "diverged"):
            check_reused_tokenizer(directory, corpus.tokenizer.chars)
        else:
            resume = (directory / "checkpoint.pt").is_file()
            try:
                train(cfg, directory, resume=resume, quiet=True, desc=name)
            except TrainingDiverged:
                pass
            summary = _read_json(directory / "summary.json")
        status = summary.get("status", "missing")
        loss = summary.get("final_val_loss") if status == "completed" else None
        points.append(SweepPoint(kind, width, depth, log2_lr, status, loss,
                                 float(summary.get("elapsed_s") or 0.0)))
        if not quiet:
            shown = f"{loss:.4f}" if loss is not None else status
            log(f"sweep [{index}/{len(plan)}] {name}: final validation loss {shown}")
    return points


def _flat(tree: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "learning_rates":
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _check_same_settings(directory: Path, cfg: Config) -> None:
    """A point found in the run directory is reused only if it ran with these settings (the
    vocabulary aside: a run saves its corpus's); else RunError names what differs."""
    from .rundir import RunError
    from .train import load_run_config

    saved = _flat(load_run_config(directory).to_dict())
    wanted = _flat(cfg.to_dict())
    wanted["model.vocab_size"] = saved.get("model.vocab_size")
    differing = [key for key in sorted(set(saved) | set(wanted))
                 if not key.startswith("compare.") and saved.get(key) != wanted.get(key)]
    if differing:
        raise RunError(f"{directory} was trained with other settings ({', '.join(differing[:4])})"
                       "; rerun with the same settings or choose another --run-dir")


def _best(points: Sequence[SweepPoint]) -> Optional[SweepPoint]:
    finite = [p for p in points if p.final_val_loss is not None
              and math.isfinite(p.final_val_loss)]
    return min(finite, key=lambda p: p.final_val_loss or 0.0) if finite else None


def transfer_summary(points: Sequence[SweepPoint],
                     defaults: Mapping[str, float]) -> List[Dict[str, Any]]:
    """Per kind and depth: the best log2 learning rate at each width, how far it moves across
    widths (in grid steps), whether a best point sits on the grid's edge, and how much worse the
    default learning rate does than the best, at each width where it is on the grid."""
    rows = []
    for kind in dict.fromkeys(p.kind for p in points):
        for depth in sorted({p.depth for p in points if p.kind == kind}):
            mine = [p for p in points if p.kind == kind and p.depth == depth]
            widths = sorted({p.width for p in mine})
            best: Dict[int, Optional[int]] = {}
            edge = False
            default_gap: Dict[int, Optional[float]] = {}
            log2_default = math.log2(defaults[kind])
            for width in widths:
                at_width = [p for p in mine if p.width == width]
                winner = _best(at_width)
                best[width] = winner.log2_lr if winner else None
                grid = sorted(p.log2_lr for p in at_width)
                edge = edge or (winner is not None and winner.log2_lr in (grid[0], grid[-1]))
                default_point = next((p for p in at_width if p.log2_lr == log2_default), None)
                default_gap[width] = (
                    100.0 * (default_point.final_val_loss / winner.final_val_loss - 1)
                    if winner and winner.final_val_loss and default_point
                    and default_point.final_val_loss is not None else None)
            found = [b for b in best.values() if b is not None]
            rows.append({
                "kind": kind, "depth": depth, "best_log2_lr": best,
                "shift_steps": (max(found) - min(found)) if found else None,
                "best_on_grid_edge": edge, "default_learning_rate": defaults[kind],
                "default_gap_percent": default_gap,
            })
    return rows


def format_sweep_tables(points: Sequence[SweepPoint], defaults: Mapping[str, float]) -> str:
    """Markdown: one table of final validation losses per kind and depth (rows: widths; the
    best of each row in bold), then the transfer summary."""
    out: List[str] = []
    for row in transfer_summary(points, defaults):
        kind, depth = row["kind"], row["depth"]
        mine = [p for p in points if p.kind == kind and p.depth == depth]
        exponents = sorted({p.log2_lr for p in mine})
        out.append(f"**{kind}**, depth {depth} (default learning rate "
                   f"{defaults[kind]:g}): final validation loss")
        out.append("")
        out.append("| width | " + " | ".join(f"2^{e}" for e in exponents) + " |")
        out.append("|---|" + "---|" * len(exponents))
        for width in sorted({p.width for p in mine}):
            cells = []
            for e in exponents:
                point = next((p for p in mine if p.width == width and p.log2_lr == e), None)
                if point is None:
                    cells.append("")
                elif point.final_val_loss is None:
                    cells.append(point.status)
                else:
                    text = f"{point.final_val_loss:.4f}"
                    cells.append(f"**{text}**" if row["best_log2_lr"][width] == e else text)
            out.append(f"| {width} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("| model | depth | best learning rate by width | shift across widths | "
               "default learning rate: loss above the best |")
    out.append("|---|---|---|---|---|")
    for row in transfer_summary(points, defaults):
        best = ", ".join(f"{w}: 2^{b}" if b is not None else f"{w}: -"
                         for w, b in row["best_log2_lr"].items())
        shift = "-" if row["shift_steps"] is None else f"{row['shift_steps']} grid step(s)"
        if row["best_on_grid_edge"]:
            shift += " (a best point is on the grid's edge)"
        gaps = row["default_gap_percent"]
        if all(g is None for g in gaps.values()):
            gap_text = f"{row['default_learning_rate']:g} is not on the grid"
        else:
            gap_text = ", ".join(f"{w}: {g:+.2f}%" if g is not None else f"{w}: -"
                                 for w, g in gaps.items())
        out.append(f"| {row['kind']} | {row['depth']} | {best} | {shift} | {gap_text} |")
    return "\n".join(out)


def plot_sweep(points: Sequence[SweepPoint], defaults: Mapping[str, float], out: Path) -> Path:
    """The transfer plot: loss against log2 learning rate, one curve per width, one panel per
    kind (and depth); the default learning rate dashed, each curve's best point ringed."""
    from .plots import _pyplot

    plt = _pyplot()
    panels = list(dict.fromkeys((p.kind, p.depth) for p in points))
    figure, axes_list = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2),
                                     squeeze=False)
    for axes, (kind, depth) in zip(axes_list[0], panels):
        mine = [p for p in points if p.kind == kind and p.depth == depth]
        finite = [p.final_val_loss for p in mine if p.final_val_loss is not None]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        for width in sorted({p.width for p in mine}):
            curve = sorted((p for p in mine if p.width == width and p.final_val_loss is not None),
                           key=lambda p: p.log2_lr)
            if not curve:
                continue
            (line,) = axes.plot([p.log2_lr for p in curve], [p.final_val_loss for p in curve],
                                "o-", label=f"width {width}")
            best = _best(curve)
            if best is not None:
                axes.plot([best.log2_lr], [best.final_val_loss], "o", markersize=12,
                          markerfacecolor="none", color=line.get_color())
        axes.axvline(math.log2(defaults[kind]), color="gray", linestyle="--",
                     label=f"default {defaults[kind]:g}")
        # A learning rate that nearly diverges would squash the rest: show 0.6 nats at most.
        axes.set_ylim(bottom=low - 0.02, top=min(high, low + 0.6) + 0.02)
        axes.set_xlabel("log2 learning rate")
        axes.set_ylabel("final validation loss (nats per character)")
        axes.set_title(f"{kind}, depth {depth}")
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
    _save(plt, figure, out)
    return out

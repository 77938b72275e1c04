"""``ipu-unit-scaling sweep``: a model trained over a grid of one setting (the learning rate, or
any config key) at several widths and depths, and whether the best value moves with width
(u-μP's promise is that it does not).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..training.config_files import ConfigError, apply_override
from ..training.run_config import Config, config_from_dict
from .experiments import DEFAULT_REGIME, read_json_or_empty, save_laid_out_figure, write_text_file

if TYPE_CHECKING:
    from ..training.data import Corpus

__all__ = [
    "SweepPoint",
    "default_exponents",
    "parse_sweep_values",
    "kinds_using",
    "run_sweep",
    "sweep_report",
    "transfer_summary",
    "format_sweep_tables",
]



# ------------------------------------------------------------------------------- sweeps

# Settings every sweep point has chosen for it, and what chooses them: a key sweep of one of
# these would be overwritten point by point.
SWEEP_OWN_SETTINGS = {
    "model.hidden_size": "--widths",
    "model.depth": "--depths",
    "training.learning_rate": "the learning-rate sweep (--log2-lr, --span)",
    "training.eval_interval": "the sweep (a point evaluates once, at the end)",
    "model.unit_scaled": "--models",
    "model.parametrization": "--models",
}

# Keys a model kind keeps in its config but never reads: the plain model's residual adds are
# unweighted, so unit scaling's taus do nothing there.
IGNORED_KEYS = {"plain": ("model.attn_tau", "model.mlp_tau")}


@dataclass
class SweepPoint:
    """One trained point of a sweep: of the learning rate (``key`` None) or of a config key."""

    kind: str  # plain, unit or u-mup
    width: int
    depth: int
    log2_lr: Optional[int]  # the swept learning rate 2^log2_lr; None where a key is swept
    status: str  # completed, diverged, ...
    final_val_loss: Optional[float]
    elapsed_s: float
    key: Optional[str] = None  # the swept config key, e.g. model.residual_mult
    value: Any = None  # its value at this point

    @property
    def learning_rate(self) -> Optional[float]:
        return None if self.log2_lr is None else 2.0**self.log2_lr

    @property
    def coordinate(self) -> Any:
        """Where the point sits on the swept axis: its log2 learning rate, or the key's value."""
        return self.log2_lr if self.key is None else self.value


def default_exponents(config: Config, kind: str, span: int) -> List[int]:
    """Powers of two around the kind's default learning rate: ``round(log2 lr) +- span``."""
    centre = round(math.log2(config.compare.learning_rates[DEFAULT_REGIME[kind]]))
    return list(range(centre - span, centre + span + 1))


def point_config(config: Config, kind: str, width: int, depth: int,
                 log2_lr: Optional[int]) -> Config:
    """The config of one sweep point; ``log2_lr`` None: the kind's default learning rate."""
    from ..training.precision import with_model_kind

    learning_rate = (config.compare.learning_rates[DEFAULT_REGIME[kind]]
                     if log2_lr is None else 2.0**log2_lr)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(with_model_kind(config.model, kind), hidden_size=width,
                                  depth=depth),
        # eval_interval 0: the final validation loss is what a sweep compares
        training=dataclasses.replace(config.training, learning_rate=learning_rate,
                                     eval_interval=0),
    )


def setting(config: Config, key: str) -> Any:
    """The value of the dotted config key ``key`` (e.g. ``model.residual_mult``)."""
    node: Any = config.to_dict()
    for part in key.split("."):
        node = node[part]
    return node


def with_setting(config: Config, key: str, value: Any) -> Config:
    """A copy of ``config`` with ``key`` set to ``value`` (a value :func:`parse_sweep_values`
    returned, so the key exists and the type is right)."""
    raw = config.to_dict()
    *sections, name = key.split(".")
    node = raw
    for part in sections:
        node = node[part]
    node[name] = value
    return config_from_dict(raw)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_sweep_values(config: Config, key: str, texts: Sequence[str]) -> List[Any]:
    """The values of ``--key KEY --values TEXT ...``, each read exactly as ``--set KEY=TEXT``
    would be and given the key's type; numbers come back in ascending order, anything else in
    the order given. A key that is not a setting, a bad value, or a value given twice is a
    ConfigError naming the key (the values' rules across fields are checked point by point by
    :func:`run_sweep`, before anything trains)."""
    section = key.split(".")[0]
    if section == "compare":
        raise ConfigError([(key, "--key: the compare section holds no setting of a run")])
    if key in SWEEP_OWN_SETTINGS:
        raise ConfigError([(key, f"--key: the sweep sets it at every point; use "
                                 f"{SWEEP_OWN_SETTINGS[key]}")])
    values: List[Any] = []
    for text in texts:
        raw = config.to_dict()
        apply_override(raw, f"{key}={text}")  # what --set does with it
        value = setting(config_from_dict(raw), key)
        if isinstance(value, dict):
            raise ConfigError([(key, "--key: is a section; name one of its keys")])
        twin = next((repr(v) for v in values if v == value), None)
        if twin is not None:
            raise ConfigError([(key, f"--values: {text!r} is {twin} again")])
        values.append(value)
    return sorted(values) if all(_is_number(v) for v in values) else values


def kinds_using(config: Config, key: str, values: Sequence[Any],
                kinds: Sequence[str] = tuple(DEFAULT_REGIME)) -> List[str]:
    """The model kinds among ``kinds`` that train with every one of ``values`` of ``key``: a
    kind that resets the key (u-μP's multipliers outside u-μP, unit scaling's taus inside it)
    would train the same model at every value."""
    using = []
    for kind in kinds:
        if key in IGNORED_KEYS.get(kind, ()):
            continue
        trained = [setting(point_config(with_setting(config, key, value), kind,
                                        config.model.hidden_size, config.model.depth, None), key)
                   for value in values]
        if trained == list(values):
            using.append(kind)
    return using


def sweep_defaults(config: Config, kinds: Sequence[str], key: Optional[str] = None
                   ) -> Dict[str, Any]:
    """Each kind's default on the swept axis: its learning rate, or the value ``key`` has in
    its points when the sweep leaves it alone."""
    if key is None:
        return {kind: config.compare.learning_rates[DEFAULT_REGIME[kind]] for kind in kinds}
    return {kind: setting(point_config(config, kind, config.model.hidden_size,
                                       config.model.depth, None), key) for kind in kinds}


def _value_label(value: Any) -> str:
    """A value as tables and plots show it."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _value_dir_name(value: Any) -> str:
    """A file name that tells the value apart from every other value of its key."""
    text = repr(value) if isinstance(value, float) else _value_label(value)
    if re.fullmatch(r"[A-Za-z0-9._+-]{1,64}", text) and text not in (".", ".."):
        return text
    digest = hashlib.sha1(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()
    return "value-" + digest[:12]


def _point_dir(run_dir: Path, kind: str, width: int, depth: int, coordinate: Any,
               key: Optional[str] = None) -> Path:
    leaf = (f"log2lr{coordinate:+d}" if key is None
            else f"{key}={_value_dir_name(coordinate)}")
    return run_dir / kind / f"w{width}-d{depth}" / leaf


def _sweep_point_config(config: Config, kind: str, width: int, depth: int, coordinate: Any,
                        key: Optional[str]) -> Config:
    if key is None:
        return point_config(config, kind, width, depth, coordinate)
    return point_config(with_setting(config, key, coordinate), kind, width, depth, None)


def run_sweep(
    config: Config,
    kinds: Sequence[str],
    widths: Sequence[int],
    depths: Sequence[int],
    exponents: Mapping[str, Sequence[int]],
    run_dir: Path,
    quiet: bool = False,
    log: Callable[[str], None] = print,
    key: Optional[str] = None,
    values: Sequence[Any] = (),
    keep_checkpoints: bool = False,
) -> List[SweepPoint]:
    """Train every (kind, depth, width, learning rate) into ``run_dir`` and write ``sweep.md``,
    ``sweep.json`` and ``sweep.png``. Finished points found in ``run_dir`` are reused,
    unfinished ones resumed; a point that diverges is recorded as such and the sweep goes on.

    With ``key``, the axis is that config key's ``values`` (from :func:`parse_sweep_values`)
    instead of the learning rate, each kind at its default learning rate; a kind that does not
    use the key is refused (ConfigError), as is any point whose config does not validate.

    A point that finishes (completed or diverged) keeps its config, metrics, summary and figure
    but not its ``checkpoint.pt``, which the sweep's results do not need (a 50-step sweep of
    45 points would keep hundreds of MB), unless ``keep_checkpoints``; an unfinished point
    keeps it, to be resumed."""
    from ..training.data import load_corpus
    from ..training.run_config import validate
    from ..training.run_directory import RunLock, make_run_dir

    axis = {kind: list(exponents[kind]) if key is None else list(values) for kind in kinds}
    if key is not None:
        using = kinds_using(config, key, values)
        for kind in kinds:
            if kind not in using:
                hint = (f"sweep it with --models {' '.join(using)}" if using
                        else "no model kind does")
                raise ConfigError([(key, f"--key: model {kind} does not use it (its points "
                                         f"would all train with the default); {hint}")])
    plan = [(kind, depth, width, c) for kind in kinds for depth in depths for width in widths
            for c in axis[kind]]
    for kind, depth, width, coordinate in plan:  # every point is checked before the first trains
        validate(_sweep_point_config(config, kind, width, depth, coordinate, key))
    make_run_dir(run_dir)
    with RunLock(run_dir):  # one sweep at a time in a directory
        check_sweep_dir(run_dir, key)
        corpus = load_corpus(config.data.path, config.data.val_fraction, config.model.seq_len)
        points = train_points(config, plan, run_dir, quiet, log, corpus, key,
                              keep_checkpoints)
        defaults = sweep_defaults(config, kinds, key)
        learning_rates = sweep_defaults(config, kinds)
        write_text_file(run_dir / "sweep.md", sweep_report(config, points) + "\n")
        payload: Dict[str, Any] = {"points": [vars(p) for p in points]}
        if key is None:
            payload["default_learning_rates"] = defaults
        else:
            payload.update(key=key, values=list(values), default_values=defaults,
                           learning_rates=learning_rates)
        payload["summary"] = transfer_summary(points, defaults)
        write_text_file(run_dir / "sweep.json", json.dumps(payload, indent=2))
        plot_sweep(points, defaults, run_dir / "sweep.png")
    return points


SWEEP_FILES = ("sweep.md", "sweep.json", "sweep.png")


def check_sweep_dir(run_dir: Path, key: Optional[str]) -> None:
    """RunError unless ``run_dir`` is empty or a sweep of the same axis (``key``, None for the
    learning rate): its results would be overwritten by another sweep's."""
    from ..training.config_names import MODEL_KINDS
    from ..training.run_directory import RunError, check_own_kind, read_json

    check_own_kind(run_dir, "sweep", SWEEP_FILES, lambda name: name in MODEL_KINDS)
    earlier = read_json(run_dir / "sweep.json")
    if (run_dir / "sweep.json").exists() and earlier is None:
        raise RunError(f"run directory {run_dir}: its sweep.json cannot be read to tell which "
                       "sweep it holds; nothing was changed: choose another --run-dir")
    if earlier is not None and earlier.get("key") != key:
        def axis(name: Optional[str]) -> str:
            return f"--key {name}" if name else "the learning rate"

        raise RunError(f"run directory {run_dir} holds a sweep of {axis(earlier.get('key'))}; "
                       f"a sweep of {axis(key)} would overwrite its sweep.md, sweep.json and "
                       "sweep.png: nothing was changed: choose another --run-dir")


def sweep_report(config: Config, points: Sequence[SweepPoint]) -> str:
    """:func:`format_sweep_tables` of a sweep of ``config``, with the defaults it implies."""
    kinds = list(dict.fromkeys(p.kind for p in points))
    key = points[0].key if points else None
    learning_rates = sweep_defaults(config, kinds) if key is not None else None
    return format_sweep_tables(points, sweep_defaults(config, kinds, key), learning_rates)


def train_points(config: Config, plan: Sequence[Tuple[str, int, int, Any]], run_dir: Path,
                 quiet: bool, log: Callable[[str], None], corpus: Corpus,
                 key: Optional[str] = None, keep_checkpoints: bool = False
                 ) -> List[SweepPoint]:
    """Train the sweep points of ``plan`` into ``run_dir``; their summaries."""
    from ..loop.run_opening import check_reused_tokenizer
    from ..loop.run_outcomes import TrainingDiverged
    from ..loop.training_loop import train
    from ..training.run_directory import CHECKPOINT_FILE, RunError
    from .progress import RunCounter

    points: List[SweepPoint] = []
    counter = RunCounter("sweep", len(plan), quiet, say=log)
    for index, (kind, depth, width, coordinate) in enumerate(plan, 1):
        directory = _point_dir(run_dir, kind, width, depth, coordinate, key)
        summary = read_json_or_empty(directory / "summary.json")
        where = (f"lr 2^{coordinate}" if key is None
                 else f"{key}={_value_label(coordinate)}")
        name = f"{kind} w{width} d{depth} {where}"
        cfg = _sweep_point_config(config, kind, width, depth, coordinate, key)
        if summary or (directory / "checkpoint.pt").is_file():
            _check_same_settings(directory, cfg)
        if summary and summary.get("data_sha256") != corpus.sha256:
            raise RunError(f"{directory} was trained with other settings (data: {corpus.source} "
                           "is not the text it trained on); rerun with the same settings or "
                           "choose another --run-dir")
        trained = summary.get("status") not in ("completed", "diverged")
        counter.start(index, name)
        if not trained:
            check_reused_tokenizer(directory, corpus.tokenizer.chars)
        else:
            resume = (directory / "checkpoint.pt").is_file()
            try:
                train(cfg, directory, resume=resume, quiet=True, desc=name)
            except TrainingDiverged:
                pass
            summary = read_json_or_empty(directory / "summary.json")
            if summary.get("status") in ("completed", "diverged") and not keep_checkpoints:
                # The results need the summary and metrics; the weights stay only if asked.
                try:
                    (directory / CHECKPOINT_FILE).unlink()
                except FileNotFoundError:
                    pass
        status = summary.get("status", "missing")
        loss = summary.get("final_val_loss") if status == "completed" else None
        points.append(SweepPoint(kind, width, depth, coordinate if key is None else None,
                                 status, loss, float(summary.get("elapsed_s") or 0.0),
                                 key, None if key is None else coordinate))
        shown = f"{loss:.4f}" if loss is not None else status
        counter.finish(index, name, f"final validation loss {shown}"
                       + ("" if trained else ", reused"), trained=trained)
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
    from ..loop.run_opening import load_run_config
    from ..training.run_directory import RunError

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


def _grid(points: Sequence[SweepPoint]) -> List[Any]:
    """The points' places on the swept axis, in grid order: numbers ascending, other values
    (a swept string or list) in the order the points come."""
    found: List[Any] = []
    for point in points:
        if point.coordinate not in found:
            found.append(point.coordinate)
    return sorted(found) if all(_is_number(c) for c in found) else found


def transfer_summary(points: Sequence[SweepPoint],
                     defaults: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """Per kind and depth: the best value at each width (the log2 learning rate, or the swept
    key's value), how far it moves across widths (in grid steps) and so whether it ``moves``
    (None with fewer than two widths to compare), whether a best point sits on the edge of a
    numeric grid, and how much worse the default (``defaults``: kind -> learning rate, or the
    key's value) does than the best, at each width where it is on the grid."""
    rows = []
    for kind in dict.fromkeys(p.kind for p in points):
        for depth in sorted({p.depth for p in points if p.kind == kind}):
            mine = [p for p in points if p.kind == kind and p.depth == depth]
            key = mine[0].key
            grid = _grid(mine)
            numeric = all(_is_number(c) for c in grid)
            default = math.log2(defaults[kind]) if key is None else defaults[kind]
            best: Dict[int, Any] = {}
            edge = False
            default_gap: Dict[int, Optional[float]] = {}
            for width in sorted({p.width for p in mine}):
                at_width = [p for p in mine if p.width == width]
                winner = _best(at_width)
                best[width] = winner.coordinate if winner else None
                own = _grid(at_width)
                edge = edge or (numeric and winner is not None
                                and winner.coordinate in (own[0], own[-1]))
                default_point = next((p for p in at_width if p.coordinate == default), None)
                default_gap[width] = (
                    100.0 * (default_point.final_val_loss / winner.final_val_loss - 1)
                    if winner and winner.final_val_loss and default_point
                    and default_point.final_val_loss is not None else None)
            steps = [grid.index(b) for b in best.values() if b is not None]
            shift = (max(steps) - min(steps)) if steps else None
            row: Dict[str, Any] = {"kind": kind, "depth": depth}
            if key is None:
                row["best_log2_lr"] = best
            else:
                row.update(key=key, best_value=best)
            moves = None if shift is None or len(steps) < 2 else shift > 0
            row.update(shift_steps=shift, moves=moves,
                       best_on_grid_edge=edge, default_gap_percent=default_gap)
            if key is None:
                row["default_learning_rate"] = defaults[kind]
            else:
                row["default_value"] = defaults[kind]
            rows.append(row)
    return rows


def _shift_text(row: Mapping[str, Any]) -> str:
    if row["shift_steps"] is None:
        return "-"
    text = f"{row['shift_steps']} grid step(s)"
    if row["moves"] is not None:
        text += ": moves" if row["moves"] else ": stays put"
    if row["best_on_grid_edge"]:
        text += " (a best point is on the grid's edge)"
    return text


def format_sweep_tables(points: Sequence[SweepPoint], defaults: Mapping[str, Any],
                        learning_rates: Optional[Mapping[str, float]] = None) -> str:
    """Markdown: one table of final validation losses per kind and depth (rows: widths; the
    best of each row in bold), then the transfer summary. ``defaults``: kind -> its default
    learning rate, or in a key sweep the key's default value (and ``learning_rates`` the rate
    each kind trained at)."""
    out: List[str] = []
    summary = transfer_summary(points, defaults)
    key = points[0].key if points else None
    for row in summary:
        kind, depth = row["kind"], row["depth"]
        mine = [p for p in points if p.kind == kind and p.depth == depth]
        grid = _grid(mine)
        best = row["best_log2_lr" if key is None else "best_value"]
        if key is None:
            out.append(f"**{kind}**, depth {depth} (default learning rate "
                       f"{defaults[kind]:g}): final validation loss")
        else:
            rate = (f"; learning rate {learning_rates[kind]:g}"
                    if learning_rates and kind in learning_rates else "")
            out.append(f"**{kind}**, depth {depth} ({key}, default "
                       f"{_value_label(defaults[kind])}{rate}): final validation loss")
        out.append("")
        labels = [f"2^{c}" if key is None else _value_label(c) for c in grid]
        out.append("| width | " + " | ".join(labels) + " |")
        out.append("|---|" + "---|" * len(grid))
        for width in sorted({p.width for p in mine}):
            cells = []
            for c in grid:
                point = next((p for p in mine if p.width == width and p.coordinate == c), None)
                if point is None:
                    cells.append("")
                elif point.final_val_loss is None:
                    cells.append(point.status)
                else:
                    text = f"{point.final_val_loss:.4f}"
                    cells.append(f"**{text}**" if best[width] == c else text)
            out.append(f"| {width} | " + " | ".join(cells) + " |")
        out.append("")
    what = "learning rate" if key is None else key
    out.append(f"| model | depth | best {what} by width | shift across widths | "
               f"default {'learning rate' if key is None else 'value'}: loss above the best |")
    out.append("|---|---|---|---|---|")
    for row in summary:
        if key is None:
            best_text = ", ".join(f"{w}: 2^{b}" if b is not None else f"{w}: -"
                                  for w, b in row["best_log2_lr"].items())
            default_text = f"{row['default_learning_rate']:g}"
        else:
            best_text = ", ".join(f"{w}: {_value_label(b)}" if b is not None else f"{w}: -"
                                  for w, b in row["best_value"].items())
            default_text = _value_label(row["default_value"])
        gaps = row["default_gap_percent"]
        if all(g is None for g in gaps.values()):
            gap_text = f"{default_text} is not on the grid"
        else:
            gap_text = ", ".join(f"{w}: {g:+.2f}%" if g is not None else f"{w}: -"
                                 for w, g in gaps.items())
        out.append(f"| {row['kind']} | {row['depth']} | {best_text} | {_shift_text(row)} | "
                   f"{gap_text} |")
    return "\n".join(out)


def plot_sweep(points: Sequence[SweepPoint], defaults: Mapping[str, Any], out: Path) -> Path:
    """The transfer plot: loss against log2 learning rate (or the swept key's values, evenly
    spaced), one curve per width, one panel per kind (and depth); the default dashed, each
    curve's best point ringed."""
    from ..training.plots import load_pyplot

    plt = load_pyplot()
    panels = list(dict.fromkeys((p.kind, p.depth) for p in points))
    figure, axes_list = plt.subplots(1, len(panels), figsize=(5 * len(panels), 5.0),
                                     squeeze=False)
    for axes, (kind, depth) in zip(axes_list[0], panels):
        mine = [p for p in points if p.kind == kind and p.depth == depth]
        key = mine[0].key
        grid = _grid(mine)

        def place(coordinate: Any, key: Optional[str] = key, grid: List[Any] = grid) -> float:
            # Learning rates sit at their log2, a key's values evenly in grid order.
            return float(coordinate) if key is None else float(grid.index(coordinate))

        finite = [p.final_val_loss for p in mine if p.final_val_loss is not None]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        for width in sorted({p.width for p in mine}):
            curve = sorted((p for p in mine if p.width == width and p.final_val_loss is not None),
                           key=lambda p: place(p.coordinate))
            if not curve:
                continue
            (line,) = axes.plot([place(p.coordinate) for p in curve],
                                [p.final_val_loss for p in curve], "o-", label=f"width {width}")
            best = _best(curve)
            if best is not None:
                axes.plot([place(best.coordinate)], [best.final_val_loss], "o", markersize=12,
                          markerfacecolor="none", color=line.get_color())
        if key is None:
            axes.axvline(math.log2(defaults[kind]), color="gray", linestyle="--",
                         label=f"default {defaults[kind]:g}")
            axes.set_xlabel("log2 learning rate")
        else:
            if defaults[kind] in grid:
                axes.axvline(place(defaults[kind]), color="gray", linestyle="--",
                             label=f"default {_value_label(defaults[kind])}")
            axes.set_xticks(range(len(grid)))
            axes.set_xticklabels([_value_label(c) for c in grid])
            axes.set_xlabel(key)
        # A setting that nearly diverges would squash the rest: show 0.6 nats at most.
        axes.set_ylim(bottom=low - 0.02, top=min(high, low + 0.6) + 0.02)
        axes.set_ylabel("final validation loss (nats per character)")
        axes.set_title(f"{kind}, depth {depth}")
        # Below the panel, never over a curve.
        axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        axes.grid(alpha=0.3)
    save_laid_out_figure(plt, figure, out)
    return out

"""What the figures of compare, compare --model bert and sweep show: a look per regime, legends
off the curves, means with bands; and the notes and progress lines around them."""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any, Dict, List

import pytest

from ipu_unit_scaling.training.plots import curve_styles, plot_compare
from ipu_unit_scaling.training.precision import REGIME_SETTINGS, regime_config
from ipu_unit_scaling.training.run_config import Config

REGIMES = list(REGIME_SETTINGS)


def _drawn(monkeypatch) -> List[Dict[str, Any]]:
    """For each figure saved: per axes, its curves' (label, colour, line style, points), its
    filled bands, error bars, and the window extents of the axes and of its legend."""
    import matplotlib.colors as colors
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure

    saved: List[Dict[str, Any]] = []
    save = Figure.savefig

    def record(self, *args, **kwargs):
        self.canvas.draw()
        renderer = self.canvas.get_renderer()
        panels = []
        for axes in self.axes:
            legend = axes.get_legend()
            panels.append({
                "lines": [(line.get_label(), colors.to_hex(line.get_color()),
                           line.get_linestyle(), len(line.get_xdata()))
                          for line in axes.get_lines() if not line.get_label().startswith("_")],
                "bands": [c for c in axes.collections if isinstance(c, PolyCollection)],
                "errorbars": [c for c in axes.containers
                              if type(c).__name__ == "ErrorbarContainer"],
                "axes": axes.get_window_extent(renderer),
                "legend": None if legend is None else legend.get_window_extent(renderer),
            })
        saved.append({"panels": panels})
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def _curve(offset: float, steps=range(50, 501, 50)):
    return [(s, 1.5 + 2.0 * math.exp(-s / 150) + offset) for s in steps]


def test_every_regime_has_its_own_look_and_keeps_it_in_every_figure():
    styles = curve_styles(REGIMES)
    looks = {(s["color"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == len(REGIMES) == 12
    # The same regime looks the same whatever else a figure holds.
    assert curve_styles(["umup-fp8", "fp32"])["umup-fp8"] == styles["umup-fp8"]
    # Names that are not regimes take looks no name in the figure has.
    mixed = curve_styles(REGIMES + ["width 64", "width 128", "other"])
    assert len({(s["color"], s["linestyle"]) for s in mixed.values()}) == 15


def test_twelve_regimes_draw_twelve_distinct_curves_and_the_legend_covers_none(
        tmp_path, monkeypatch):
    saved = _drawn(monkeypatch)
    curves = {regime: _curve(0.02 * i) for i, regime in enumerate(REGIMES)}
    plot_compare(curves, tmp_path / "compare.png", 3.2)
    (panel,) = saved[0]["panels"]
    drawn = {label: (colour, style) for label, colour, style, _ in panel["lines"]}
    assert set(REGIMES) <= set(drawn)
    assert len({drawn[r] for r in REGIMES}) == 12
    legend, axes = panel["legend"], panel["axes"]
    assert legend.x0 >= axes.x1 or legend.y1 <= axes.y0, (legend, axes)  # beside or below


def test_a_mean_over_seeds_is_one_curve_with_a_band(tmp_path, monkeypatch):
    saved = _drawn(monkeypatch)
    curves = {"fp32": [(s, v, 0.05) for s, v in _curve(0.0)],
              "unit-fp8": [(s, v, 0.0) for s, v in _curve(0.1)]}
    plot_compare(curves, tmp_path / "compare.png", None)
    (panel,) = saved[0]["panels"]
    assert [label for label, *_ in panel["lines"]] == ["fp32", "unit-fp8"]
    assert len(panel["bands"]) == 1  # a band where the seeds spread, none where they agree


def test_runs_evaluated_once_are_markers_with_std_bars_not_a_column_of_dots(
        tmp_path, monkeypatch):
    saved = _drawn(monkeypatch)
    curves = {regime: [(100, 2.5 + 0.1 * i, 0.05)] for i, regime in
              enumerate(["fp32", "fp16", "fp8-naive", "unit-fp16", "unit-fp8"])}
    plot_compare(curves, tmp_path / "compare.png", None)
    (panel,) = saved[0]["panels"]
    assert len(panel["errorbars"]) == 5
    # Each regime at its own x position, not all at step 100.
    xs = [bar.lines[0].get_xdata()[0] for bar in panel["errorbars"]]
    assert len(set(xs)) == 5


def test_bert_compare_draws_the_mean_over_seeds_of_each_regime(tmp_path, monkeypatch):
    from ipu_unit_scaling.apps.mlm import MLM_REGIMES, MLMConfig, write_comparison

    saved = _drawn(monkeypatch)
    seeds = [0, 1, 2]
    runs = {(regime, seed): {
        "status": "completed", "final_val_loss": 2.0 + 0.1 * i + 0.01 * seed,
        "final_val_metrics": {"accuracy": 0.3}, "elapsed_s": 1.0,
        "val_curve": [[step, 3.0 - step / 100 + 0.1 * i + 0.01 * seed] for step in (20, 40, 60)],
    } for i, regime in enumerate(MLM_REGIMES) for seed in seeds}
    write_comparison(MLMConfig(), list(MLM_REGIMES), seeds, tmp_path, runs)
    (panel,) = saved[0]["panels"]
    assert [label for label, *_ in panel["lines"]] == list(MLM_REGIMES)  # not 15 seed lines
    assert all(points == 3 for *_, points in panel["lines"])
    assert len(panel["bands"]) == len(MLM_REGIMES)


def test_the_sweep_legends_sit_below_their_panels(tmp_path, monkeypatch):
    from ipu_unit_scaling.apps.sweep import SweepPoint, plot_sweep

    saved = _drawn(monkeypatch)
    points = [SweepPoint(kind, width, 2, e, "completed", 2.0 + 0.05 * (e + 2) ** 2, 1.0)
              for kind in ("unit", "u-mup") for width in (64, 128) for e in range(-4, 1)]
    plot_sweep(points, {"unit": 2 ** -4, "u-mup": 1.0}, tmp_path / "sweep.png")
    for panel in saved[0]["panels"]:
        assert panel["legend"].y1 <= panel["axes"].y0


def test_umup_regimes_at_their_defaults_are_marked_untuned():
    from ipu_unit_scaling.apps.compare import format_compare_table, untuned
    from ipu_unit_scaling.apps.experiments import UNTUNED_MARK

    config = Config()
    assert untuned(regime_config(config, "umup-fp32"), "umup-fp32")
    assert not untuned(regime_config(config, "unit-fp32"), "unit-fp32")
    tuned = regime_config(config, "umup-fp8")
    tuned = replace(tuned, model=replace(tuned.model, residual_mult=0.125))
    assert not untuned(tuned, "umup-fp8")
    faster = regime_config(config, "umup-fp8")
    faster = replace(faster, training=replace(faster.training, learning_rate=0.5))
    assert not untuned(faster, "umup-fp8")
    rows = [{"regime": regime, "model": "m", "precision": "p", "learning_rate": 1.0,
             "status": "completed", "steps": 2, "final_val_loss": 2.0, "elapsed_s": 1.0,
             "gap_to_fp32_percent": 1.0, "untuned": regime.startswith("umup")}
            for regime in ("fp32", "umup-fp32")]
    table = format_compare_table(rows, None)
    # The model column says so; the regime column stays the regime's name.
    assert f"| umup-fp32 | m {UNTUNED_MARK} |" in table and "| fp32 | m |" in table
    assert "residual-mult-sweep" in table  # where the better values are


def test_progress_lines_count_runs_and_estimate_the_time_left():
    from ipu_unit_scaling.apps.progress import RunCounter

    now = [0.0]
    lines: List[str] = []
    counter = RunCounter("compare", 3, say=lines.append, clock=lambda: now[0])
    counter.start(1, "fp32", "training")
    now[0] = 60.0
    counter.finish(1, "fp32", "final validation loss 1.6000")
    counter.start(2, "fp16", "reusing the finished run")
    counter.finish(2, "fp16", "final validation loss 1.7000", trained=False)
    assert lines[0] == "compare [1/3] fp32: training"
    assert lines[1] == ("compare [1/3] fp32: final validation loss 1.6000 "
                        "(1 min 00 s so far, about 2 min 00 s left)")
    assert lines[2] == "compare [2/3] fp16: reusing the finished run (about 2 min 00 s left)"
    assert lines[3].endswith("(1 min 00 s so far, about 1 min 00 s left)")  # reuse costs 0


def test_a_run_says_where_its_tensorboard_scalars_go_or_why_not(tmp_path, monkeypatch):
    from ipu_unit_scaling.training.tensorboard_log import TensorBoardLog

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    log = TensorBoardLog(tmp_path, 0)
    assert log.writer is None and "TensorBoard is not installed" in log.note
    assert not (tmp_path / "tensorboard").exists()
    assert TensorBoardLog(None, 0).note == ""  # ranks that write nothing say nothing


def test_a_given_model_is_named_by_its_factory():
    from ipu_unit_scaling.training.precision import model_label

    config = Config()
    assert model_label(config.model) == "unit-scaled GPT"
    config = replace(config, model=replace(config.model, factory="my_model:build"))
    assert model_label(config.model) == "my_model:build (model.factory)"
    assert "GPT" not in model_label(config.model)


@pytest.mark.parametrize("keep", [False, True])
def test_a_sweep_keeps_a_finished_points_checkpoint_only_when_asked(tmp_path, monkeypatch, keep):
    import json
    from types import SimpleNamespace

    import ipu_unit_scaling.loop.training_loop as loop
    from ipu_unit_scaling.apps.sweep import train_points

    def fake_train(cfg, directory, **kwargs):  # a point that finishes, or one still running
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "checkpoint.pt").write_bytes(b"weights")
        status = "stopped" if "w64" in str(directory) else "completed"
        (directory / "summary.json").write_text(json.dumps(
            {"status": status, "final_val_loss": 2.0, "elapsed_s": 1.0}))

    monkeypatch.setattr(loop, "train", fake_train)
    lines: List[str] = []
    plan = [("unit", 2, 32, -4), ("unit", 2, 64, -4)]
    corpus = SimpleNamespace(sha256="", source="", tokenizer=SimpleNamespace(chars=[]))
    points = train_points(Config(), plan, tmp_path, False, lines.append, corpus,
                          keep_checkpoints=keep)
    assert [p.status for p in points] == ["completed", "stopped"]
    assert (tmp_path / "unit" / "w32-d2" / "log2lr-4" / "checkpoint.pt").exists() == keep
    assert (tmp_path / "unit" / "w64-d2" / "log2lr-4" / "checkpoint.pt").exists()  # to resume
    assert (tmp_path / "unit" / "w32-d2" / "log2lr-4" / "summary.json").exists()
    assert lines[0].startswith("sweep [1/2] unit w32 d2 lr 2^-4: final validation loss 2.0000")

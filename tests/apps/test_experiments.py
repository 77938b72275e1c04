"""compare --seeds and sweep: the statistics by hand, and both commands on tiny configs."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from helpers import ONE_IPU as FAST
from helpers import run

from ipu_unit_scaling.apps.experiments import aggregate_seeds, mean_curves
from ipu_unit_scaling.apps.sweep import (
    SweepPoint,
    default_exponents,
    format_sweep_tables,
    transfer_summary,
)
from ipu_unit_scaling.training.run_config import load_config


def _row(regime: str, loss):
    return {"regime": regime, "model": "m", "precision": "p", "learning_rate": 0.1,
            "final_val_loss": loss, "elapsed_s": 1.0}


def test_seed_statistics_and_paired_gaps_by_hand():
    per_seed = {
        0: [_row("fp32", 2.0), _row("unit-fp8", 1.9)],
        1: [_row("fp32", 2.2), _row("unit-fp8", 2.2)],
        2: [_row("fp32", 2.1), _row("unit-fp8", None)],  # diverged
    }
    fp32, unit = aggregate_seeds(per_seed)
    assert fp32.mean == pytest.approx(2.1) and fp32.std == pytest.approx(0.1)
    assert (fp32.gap_mean, fp32.gap_std) == (0.0, 0.0)
    assert unit.losses == [1.9, 2.2, None] and unit.failed == 1
    assert unit.mean == pytest.approx(2.05)
    assert unit.std == pytest.approx(statistics.stdev([1.9, 2.2]))
    gaps = [100 * (1.9 / 2.0 - 1), 0.0]  # seed by seed; the diverged seed gives none
    assert unit.gap_mean == pytest.approx(statistics.fmean(gaps))
    assert unit.gap_std == pytest.approx(statistics.stdev(gaps))


def test_mean_curves_average_over_seeds_at_each_step():
    curves = {0: {"a": [(10, 2.0), (20, 1.0)]}, 1: {"a": [(10, 4.0), (20, math.nan)]}}
    assert mean_curves(curves)["a"] == [(10, 3.0, pytest.approx(math.sqrt(2))), (20, 1.0, 0.0)]


def _points(kind: str, losses: dict) -> list:
    return [SweepPoint(kind, width, 2, e, "completed" if loss is not None else "diverged", loss,
                       1.0) for (width, e), loss in losses.items()]


def test_transfer_summary_finds_the_shift_the_edges_and_the_default_gap():
    plain = _points("plain", {(64, -6): 2.0, (64, -5): 1.9, (64, -4): 2.1,
                              (256, -6): 1.7, (256, -5): 1.8, (256, -4): None})
    umup = _points("u-mup", {(64, -2): 2.1, (64, -1): 1.9, (64, 0): 1.901, (64, 1): 2.0,
                             (256, -2): 2.0, (256, -1): 1.8, (256, 0): 1.7, (256, 1): 1.75})
    rows = {row["kind"]: row for row in transfer_summary(plain + umup,
                                                         {"plain": 0.006, "u-mup": 1.0})}
    assert rows["plain"]["best_log2_lr"] == {64: -5, 256: -6}
    assert rows["plain"]["shift_steps"] == 1 and rows["plain"]["best_on_grid_edge"]
    assert rows["plain"]["default_gap_percent"] == {64: None, 256: None}  # 0.006: off the grid
    assert rows["u-mup"]["best_log2_lr"] == {64: -1, 256: 0}
    assert rows["u-mup"]["shift_steps"] == 1 and not rows["u-mup"]["best_on_grid_edge"]
    assert rows["u-mup"]["default_gap_percent"][64] == pytest.approx(100 * (1.901 / 1.9 - 1))
    assert rows["u-mup"]["default_gap_percent"][256] == 0.0
    table = format_sweep_tables(plain + umup, {"plain": 0.006, "u-mup": 1.0})
    assert "| 256 | **1.7000** | 1.8000 | diverged |" in table
    assert "0.006 is not on the grid" in table


def test_default_grids_are_centred_on_each_models_default_rate():
    config = load_config(None)
    assert default_exponents(config, "plain", 2) == [-9, -8, -7, -6, -5]  # 0.006 ~ 2^-7.4
    assert default_exponents(config, "unit", 1) == [-5, -4, -3]  # 0.06 ~ 2^-4.06
    assert default_exponents(config, "u-mup", 2) == [-2, -1, 0, 1, 2]


def test_compare_with_seeds_on_the_tiny_config(capsys, tmp_path):
    run_dir = tmp_path / "seeds"
    status, out, _ = run(capsys, "compare", "--config", "tiny", "--run-dir", run_dir, "--quiet",
                         "--regimes", "fp32", "umup-fp8", "--seeds", "2",
                         "--set", *FAST, "training.steps=3")
    assert status == 0, out
    assert "mean ± std, 2 seeds" in out
    data = json.loads((run_dir / "compare.json").read_text())
    assert data["seeds"] == [0, 1]
    rows = {row["regime"]: row for row in data["regimes"]}
    for regime in ("fp32", "umup-fp8"):
        per_seed = [json.loads((run_dir / f"seed-{s}" / regime / "summary.json").read_text())
                    for s in (0, 1)]
        losses = [summary["final_val_loss"] for summary in per_seed]
        assert rows[regime]["losses"] == losses
        assert rows[regime]["mean"] == pytest.approx(statistics.fmean(losses))
        assert rows[regime]["std"] == pytest.approx(statistics.stdev(losses))
    assert losses[0] != losses[1]  # the seeds differ
    assert (run_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"
    # A rerun reuses every finished run of every seed.
    status, out, _ = run(capsys, "compare", "--config", "tiny", "--run-dir", run_dir,
                         "--regimes", "fp32", "umup-fp8", "--seeds", "2",
                         "--set", *FAST, "training.steps=3")
    assert status == 0 and out.count("reusing the finished run") == 4
    # One count over every seed's regimes.
    assert "compare [1/4] fp32 seed 0: reusing" in out
    assert "compare [4/4] umup-fp8 seed 1: final validation loss" in out


def test_sweep_on_the_tiny_config(capsys, tmp_path):
    run_dir = tmp_path / "sweep"
    status, out, _ = run(capsys, "sweep", "--config", "tiny", "--run-dir", run_dir, "--quiet",
                         "--models", "plain", "u-mup", "--widths", "16", "32", "--span", "1",
                         "--log2-lr", "u-mup=-1:0", "--set", *FAST, "training.steps=3",
                         "precision.dtype=fp32")
    assert status == 0, out
    data = json.loads((run_dir / "sweep.json").read_text())
    grid = {(p["kind"], p["width"], p["log2_lr"]) for p in data["points"]}
    assert grid == {("plain", w, e) for w in (16, 32) for e in (-8, -7, -6)} | \
        {("u-mup", w, e) for w in (16, 32) for e in (-1, 0)}
    for point in data["points"]:
        directory = run_dir / point["kind"] / f"w{point['width']}-d2" / \
            f"log2lr{point['log2_lr']:+d}"
        config = (directory / "config.yaml").read_text()
        assert f"hidden_size: {point['width']}" in config
        assert f"learning_rate: {2.0 ** point['log2_lr']}" in config
        summary = json.loads((directory / "summary.json").read_text())
        assert point["final_val_loss"] == summary["final_val_loss"]
    assert "u-mup" in out and "best learning rate by width" in out
    assert (run_dir / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    summary = run_dir / "u-mup" / "w16-d2" / "log2lr+0" / "summary.json"
    written = summary.stat().st_mtime_ns
    status, _, _ = run(capsys, "sweep", "--config", "tiny", "--run-dir", run_dir, "--quiet",
                       "--models", "u-mup", "--widths", "16", "--log2-lr", "u-mup=-1:0",
                       "--set", *FAST, "training.steps=3", "precision.dtype=fp32")
    assert status == 0 and summary.stat().st_mtime_ns == written  # reused, not retrained


@pytest.mark.parametrize("argv, message", [
    (["--log2-lr", "u-mup=2:1"], "--log2-lr"),
    (["--log2-lr", "plain=-3:-1", "--models", "u-mup"], "--log2-lr"),
    (["--widths", "15"], "must divide"),
])
def test_sweep_refuses_bad_grids(capsys, tmp_path, argv, message):
    status, _, err = run(capsys, "sweep", "--config", "tiny", "--run-dir", tmp_path / "s",
                         *argv)
    assert status == 2 and message in err
    assert not Path(tmp_path / "s").exists()

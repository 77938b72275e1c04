"""sweep --key KEY --values ...: a config key swept across widths instead of the learning rate."""
from __future__ import annotations

import json

import pytest
import yaml
from helpers import ONE_IPU, run

from ipu_unit_scaling.apps.sweep import (
    SweepPoint,
    format_sweep_tables,
    kinds_using,
    parse_sweep_values,
    transfer_summary,
)
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.run_config import load_config

FAST = [*ONE_IPU, "training.steps=3", "precision.dtype=fp32"]


def _points(key: str, losses: dict, kind: str = "u-mup") -> list:
    return [SweepPoint(kind, width, 2, None, "completed" if loss is not None else "diverged",
                       loss, 1.0, key, value) for (width, value), loss in losses.items()]


def test_key_sweep_trains_each_value_and_reports_the_best_by_width(capsys, tmp_path):
    run_dir = tmp_path / "sweep"
    argv = ["sweep", "--config", "tiny", "--run-dir", run_dir, "--widths", "16", "32",
            "--key", "model.residual_mult", "--values", "2", "0.5", "--set", *FAST]
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    # --models left out: only u-μP uses the multiplier, so only u-μP is swept, and it says so.
    assert "model.residual_mult acts in u-mup only" in out
    data = json.loads((run_dir / "sweep.json").read_text())
    assert data["key"] == "model.residual_mult" and data["values"] == [0.5, 2.0]
    assert {(p["kind"], p["width"], p["value"]) for p in data["points"]} == \
        {("u-mup", w, v) for w in (16, 32) for v in (0.5, 2.0)}
    for point in data["points"]:
        directory = run_dir / "u-mup" / f"w{point['width']}-d2" / \
            f"model.residual_mult={point['value']!r}"
        saved = yaml.safe_load((directory / "config.yaml").read_text())
        assert saved["model"]["residual_mult"] == point["value"]
        assert saved["model"]["hidden_size"] == point["width"]
        assert saved["model"]["parametrization"] == "u-mup"
        assert saved["training"]["learning_rate"] == data["learning_rates"]["u-mup"] == 1.0
        summary = json.loads((directory / "summary.json").read_text())
        assert point["final_val_loss"] == summary["final_val_loss"]
    (row,) = data["summary"]
    best = {}
    for width in (16, 32):
        at_width = [p for p in data["points"] if p["width"] == width]
        best[str(width)] = min(at_width, key=lambda p: p["final_val_loss"])["value"]
    assert row["best_value"] == best
    assert row["moves"] == (best["16"] != best["32"])
    assert row["default_value"] == 1.0 and "1 is not on the grid" in out
    assert "best model.residual_mult by width" in (run_dir / "sweep.md").read_text()
    assert (run_dir / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    # A rerun reuses the finished points; one with other settings is refused, not reused.
    summary_file = run_dir / "u-mup" / "w16-d2" / "model.residual_mult=0.5" / "summary.json"
    written = summary_file.stat().st_mtime_ns
    status, out, _ = run(capsys, *argv)
    assert status == 0 and summary_file.stat().st_mtime_ns == written
    status, _, err = run(capsys, *argv, "training.seed=1")
    assert status == 2 and "other settings" in err and "training.seed" in err


def test_a_model_that_does_not_use_the_key_is_refused_when_named(capsys, tmp_path):
    status, _, err = run(capsys, "sweep", "--config", "tiny", "--run-dir", tmp_path / "s",
                         "--models", "plain", "u-mup", "--key", "model.residual_mult",
                         "--values", "0.5", "1", "--set", *FAST)
    assert status == 2 and err.count("\n") == 1
    assert "model.residual_mult" in err and "model plain does not use it" in err
    assert "--models u-mup" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("argv, words", [
    (["--key", "model.residual_mul", "--values", "0.5"], ["model.residual_mul", "unknown key"]),
    (["--key", "model.residual_mult", "--values", "0.5", "abc"],
     ["model.residual_mult", "'abc'"]),
    (["--key", "model.residual_mult", "--values", "0.5", ".5"],
     ["model.residual_mult", "again"]),
    (["--key", "model.residual_mult", "--values", "-1", "1"], ["model.residual_mult", "-1"]),
    (["--key", "model.attn_softmax_mult", "--values", "1", "010"],
     ["model.attn_softmax_mult", "010"]),
    (["--key", "training.learning_rate", "--values", "0.1"],
     ["training.learning_rate", "--log2-lr"]),
    (["--key", "model.hidden_size", "--values", "64"], ["model.hidden_size", "--widths"]),
    (["--key", "compare.learning_rates", "--values", "{}"], ["compare"]),
    (["--key", "model", "--values", "1"], ["model"]),
    (["--key", "model.residual_mult"], ["--key model.residual_mult needs --values"]),
    (["--values", "1"], ["--values needs --key"]),
    (["--key", "model.residual_mult", "--values", "1", "--span", "1"], ["--span"]),
])
def test_bad_keys_and_values_are_refused_in_one_line_before_training(capsys, tmp_path, argv,
                                                                       words):
    status, out, err = run(capsys, "sweep", "--config", "tiny", "--run-dir", tmp_path / "s",
                           *argv, "--set", *FAST)
    assert status == 2 and err.count("\n") == 1, err
    for word in words:
        assert word in err
    assert "sweep [" not in out and not (tmp_path / "s").exists()


def test_values_are_read_as_set_reads_them():
    config = load_config("tiny")
    values = parse_sweep_values(config, "model.residual_mult", ["2", "0.25", "1e-1"])
    assert values == [0.1, 0.25, 2.0] and all(type(v) is float for v in values)
    # Values that are not numbers keep the order given.
    assert parse_sweep_values(config, "training.optimizer", ["sgd", "adam"]) == ["sgd", "adam"]
    with pytest.raises(ConfigError, match="training.optimizer"):
        parse_sweep_values(config, "training.optimizer", ["on"])  # YAML 1.1's boolean: refused


def test_kinds_using_a_key():
    config = load_config("tiny")
    assert kinds_using(config, "model.residual_mult", [0.5, 2.0]) == ["u-mup"]
    # u-μP sets its residual weights itself; the plain model's residual adds take no tau.
    assert kinds_using(config, "model.attn_tau", [0.5, 2.0]) == ["unit"]
    assert kinds_using(config, "model.mlp_tau", [0.5, 2.0]) == ["unit"]
    assert kinds_using(config, "training.seed", [1, 2]) == ["plain", "unit", "u-mup"]


def test_the_plain_model_ignores_the_taus_it_is_not_swept_over():
    import torch

    from ipu_unit_scaling.models import GPTConfig, build_gpt

    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    outputs = []
    for tau in (0.2, 0.9):
        torch.manual_seed(0)
        model = build_gpt(GPTConfig(vocab_size=32, seq_len=8, depth=1, hidden_size=16, heads=2,
                                    unit_scaled=False, attn_tau=tau, mlp_tau=tau))
        outputs.append(model(tokens))
    assert torch.equal(outputs[0], outputs[1])  # the same model, the same kernels


def test_transfer_summary_of_a_key_sweep():
    key = "model.residual_mult"
    # Points in no particular order: the grid is the values ascending.
    stays = _points(key, {(64, 2.0): 2.3, (64, 0.25): 2.2, (64, 0.5): 2.1, (64, 1.0): 2.15,
                          (128, 1.0): 2.05, (128, 0.5): 2.0, (128, 0.25): 2.1, (128, 2.0): None})
    (row,) = transfer_summary(stays, {"u-mup": 1.0})
    assert row["key"] == key and row["best_value"] == {64: 0.5, 128: 0.5}
    assert row["shift_steps"] == 0 and row["moves"] is False and not row["best_on_grid_edge"]
    assert row["default_gap_percent"][64] == pytest.approx(100 * (2.15 / 2.1 - 1))
    table = format_sweep_tables(stays, {"u-mup": 1.0}, {"u-mup": 0.5})
    assert "| width | 0.25 | 0.5 | 1 | 2 |" in table
    assert "| 128 | 2.1000 | **2.0000** | 2.0500 | diverged |" in table
    assert "0 grid step(s): stays put" in table and "learning rate 0.5" in table

    moves = _points(key, {(64, 0.25): 2.0, (64, 0.5): 2.1, (64, 1.0): 2.2,
                          (128, 0.25): 2.2, (128, 0.5): 2.1, (128, 1.0): 1.9}, kind="unit")
    (row,) = transfer_summary(moves, {"unit": 4.0})
    assert row["best_value"] == {64: 0.25, 128: 1.0}
    assert row["shift_steps"] == 2 and row["moves"] is True and row["best_on_grid_edge"]
    assert "4 is not on the grid" in format_sweep_tables(moves, {"unit": 4.0})

    one_width = _points(key, {(64, 0.5): 2.0, (64, 1.0): 2.1})
    assert transfer_summary(one_width, {"u-mup": 1.0})[0]["moves"] is None

    # Values that are not numbers: their order as swept, no edge (there is no order to be at
    # the end of).
    words = _points("training.optimizer", {(64, "sgd"): 2.5, (64, "adam"): 2.0,
                                           (128, "sgd"): 2.4, (128, "adam"): 2.6})
    (row,) = transfer_summary(words, {"u-mup": "adam"})
    assert row["best_value"] == {64: "adam", 128: "sgd"}
    assert row["shift_steps"] == 1 and row["moves"] is True and not row["best_on_grid_edge"]
    assert "| width | sgd | adam |" in format_sweep_tables(words, {"u-mup": "adam"})


def test_learning_rate_sweeps_say_whether_the_best_moves():
    points = [SweepPoint("plain", w, 2, e, "completed", loss, 1.0)
              for (w, e), loss in {(64, -6): 2.0, (64, -5): 1.9, (64, -4): 2.1,
                                   (128, -6): 1.7, (128, -5): 1.8, (128, -4): 1.9}.items()]
    (row,) = transfer_summary(points, {"plain": 2.0**-5})
    assert row["best_log2_lr"] == {64: -5, 128: -6} and row["moves"] is True
    assert "1 grid step(s): moves" in format_sweep_tables(points, {"plain": 2.0**-5})

"""health.png: drawn from a telemetry file; a file with nothing to draw says so."""
from __future__ import annotations

import pytest

from ipu_unit_scaling.training.health_plot import plot_health
from ipu_unit_scaling.training.telemetry_log import TelemetryLog


def test_heat_maps_and_tracks_from_the_file(tmp_path):
    log = TelemetryLog(tmp_path / "t.csv", fresh=True)
    for step in (1, 2, 4):
        log.write([dict(step=step, kind="cast", site=f"l{i}.input", role="activation",
                        format="F143", log2_scale=step - i, flushed_fraction=0.1 * i,
                        saturated_fraction=0.0) for i in range(3)])
    log.write([dict(step=4, kind="warning", site="l2.input", role="flushed", note="w")])
    log.close()
    out = plot_health(tmp_path / "t.csv", tmp_path / "health.png", "a run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nothing_to_draw(tmp_path):
    TelemetryLog(tmp_path / "t.csv", fresh=True).close()
    with pytest.raises(RuntimeError, match="no cast rows"):
        plot_health(tmp_path / "t.csv", tmp_path / "health.png")
    assert not (tmp_path / "health.png").exists()

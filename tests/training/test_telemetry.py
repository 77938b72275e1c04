"""Telemetry through a training loop (the ``Telemetry`` API of a user's own loop): what it
records, that it agrees with ``fp8_stats``, and that injected failures warn at the right sites
from the first sampled step."""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from ipu_unit_scaling.fp8 import FP8Config, fp8_stats
from ipu_unit_scaling.models import GPTConfig, build_gpt
from ipu_unit_scaling.training.run_health import (
    AS_IF_CAST,
    TelemetryConfig,
    telemetry_problems,
)
from ipu_unit_scaling.training.telemetry import (
    Telemetry,
    cast_role,
    pooled_casts,
    sampled,
)
from ipu_unit_scaling.training.telemetry_log import TELEMETRY_FIELDS, read_telemetry
from ipu_unit_scaling.transforms import simulate_fp8

SMALL = dict(vocab_size=64, seq_len=32, depth=2, hidden_size=64, heads=2)


def _model(unit_scaled: bool = True, fp8: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = build_gpt(GPTConfig(unit_scaled=unit_scaled, **SMALL))
    return simulate_fp8(model, FP8Config(scaling="static")) if fp8 else model


def _train(model: torch.nn.Module, path: Path, steps: int, lr: float = 1e-3,
           interval: int = 2) -> Tuple[List[str], Telemetry]:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    said: List[str] = []
    telemetry = Telemetry(model, optimizer, path, interval=interval, log=said.append)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        text = torch.randint(0, SMALL["vocab_size"], (8, SMALL["seq_len"] + 1),
                             generator=generator)
        with telemetry.step(step):
            loss = model(text[:, :-1], text[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        telemetry.loss(step, float(loss.detach()))
    telemetry.close()
    return said, telemetry


def test_sampled_steps_are_the_multiples_and_the_powers_of_two_below():
    assert [s for s in range(1, 120) if sampled(50, s - 1, s)] == [1, 2, 4, 8, 16, 32, 50, 100]
    # A call of several steps samples when any of its steps would be sampled.
    assert [s for s in range(4, 120, 4) if sampled(50, s - 4, s)] == [4, 8, 16, 32, 52, 100]
    assert not any(sampled(0, s - 1, s) for s in range(1, 100))


def test_bad_thresholds_are_named():
    bad = TelemetryConfig(interval=-1, flushed_warning=0.0, saturated_warning=1.5,
                          loss_spike=math.nan, update_ratio_spread=0.5)
    assert [key for key, _ in telemetry_problems(bad)] == [
        "interval", "flushed_warning", "saturated_warning", "update_ratio_spread", "loss_spike"]
    assert telemetry_problems(TelemetryConfig()) == []
    with pytest.raises(ValueError, match="telemetry.interval"):
        Telemetry(torch.nn.Linear(2, 2), None, None, interval=-3)


def test_roles_from_site_names():
    assert [cast_role(s) for s in ("a.input", "a.weight", "a.grad_output", "att.scores.a")] == \
        ["activation", "weight", "gradient", "activation"]


def test_rows_of_a_sampled_step(tmp_path):
    said, _ = _train(_model(), tmp_path / "t.csv", steps=4)
    rows = read_telemetry(tmp_path / "t.csv")
    with open(tmp_path / "t.csv", newline="") as handle:  # the csv module reads it as it is
        assert tuple(next(csv.reader(handle))) == TELEMETRY_FIELDS
    assert sorted({r["step"] for r in rows if r["kind"] != "loss"}) == [1, 2, 4]
    step2 = [r for r in rows if r["step"] == 2]
    casts = {r["site"]: r for r in step2 if r["kind"] == "cast"}
    # Every linear's input, weight and output gradient, each once.
    linears = ["layers.0.attn.qkv", "layers.0.attn.proj", "layers.0.mlp.up",
               "layers.0.mlp.down", "layers.1.attn.qkv", "layers.1.attn.proj",
               "layers.1.mlp.up", "layers.1.mlp.down", "head"]
    assert set(casts) == {f"{n}.{part}" for n in linears
                          for part in ("input", "weight", "grad_output")}
    assert casts["head.grad_output"]["format"] == "F152" and \
        casts["head.grad_output"]["role"] == "gradient"
    assert casts["head.weight"]["log2_scale"] == 0  # static scaling
    params = {r["site"]: r for r in step2 if r["kind"] == "param"}
    assert list(params) == [name for name, _ in _model().named_parameters()]
    assert all(r["update_ratio"] == pytest.approx(r["update_rms"] / r["weight_rms"], rel=0.05)
               for r in params.values())
    assert all(r["learning_rate"] == 1e-3 for r in params.values())
    logits = [r for r in step2 if r["kind"] == "attention"]
    assert [r["site"] for r in logits] == ["layers.0.attn", "layers.1.attn"]
    assert all(0 < r["amax"] < 100 for r in logits)
    assert said == []  # a healthy unit-scaled model warns of nothing


def test_the_fractions_are_what_fp8_stats_records_around_the_same_step(tmp_path):
    model = _model(unit_scaled=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    telemetry = Telemetry(model, optimizer, tmp_path / "t.csv", interval=1, log=None)
    text = torch.randint(0, SMALL["vocab_size"], (8, SMALL["seq_len"] + 1))
    with fp8_stats() as stats, telemetry.step(1):
        model(text[:, :-1], text[:, 1:]).backward()
        optimizer.step()
    telemetry.close()
    expected = pooled_casts(stats.records)
    rows = {r["site"]: r for r in read_telemetry(tmp_path / "t.csv") if r["kind"] == "cast"}
    assert set(rows) == set(expected)
    for site, figures in expected.items():
        # (the file keeps 7 significant digits)
        assert rows[site]["flushed_fraction"] == pytest.approx(figures["flushed_fraction"],
                                                               rel=1e-6, abs=1e-12), site
        assert rows[site]["saturated_fraction"] == pytest.approx(
            figures["saturated_fraction"], rel=1e-6, abs=1e-12), site
    assert any(r["flushed_fraction"] > 0.2 for r in rows.values())  # a plain model's casts


def _warned(said: List[str]) -> Dict[str, List[Tuple[int, str]]]:
    found: Dict[str, List[Tuple[int, str]]] = {}
    for line in said:
        step, site = line.split(": ")[1:3]
        found.setdefault(site, []).append((int(step.split()[1]), line))
    return found


def test_a_plain_model_under_static_fp8_warns_of_flushed_gradients_at_step_1(tmp_path):
    plain, _ = _train(_model(unit_scaled=False), tmp_path / "plain.csv", steps=2)
    unit, _ = _train(_model(unit_scaled=True), tmp_path / "unit.csv", steps=2)
    warned = _warned(plain)
    assert warned and all(site.endswith(".grad_output") for site in warned)
    assert {step for lines in warned.values() for step, _ in lines} == {1}
    assert all("flushed to zero" in line for lines in warned.values() for _, line in lines)
    assert unit == []
    warnings = [r for r in read_telemetry(tmp_path / "plain.csv") if r["kind"] == "warning"]
    assert [(r["step"], r["site"], r["role"]) for r in warnings] == \
        [(1, site, "flushed") for site in warned]


def test_one_layer_scaled_wrongly_warns_at_its_sites_only(tmp_path):
    model = _model()
    with torch.no_grad():
        model.layers[1].mlp.up.weight.mul_(2.0 ** 9)  # 512x: beyond F143's 240
    said, _ = _train(model, tmp_path / "t.csv", steps=2)
    warned = _warned(said)
    assert "layers.1.mlp.up.weight" in warned
    assert all(site.startswith("layers.1.mlp.") for site in warned), sorted(warned)


def test_warnings_do_not_repeat_until_the_site_recovers(tmp_path):
    said, telemetry = _train(_model(unit_scaled=False), tmp_path / "t.csv", steps=8,
                             interval=1)
    sites = [site for site in _warned(said)]
    assert len(sites) == len(set(sites))  # sampled 8 times, still out of range: one line each
    assert telemetry.monitor.active  # and still remembered as out of range


def test_a_float_run_records_casts_as_if_made_and_warns_of_none(tmp_path):
    with fp8_stats() as users:  # a user's own collection sees no cast the run did not make
        said, _ = _train(_model(unit_scaled=False, fp8=False), tmp_path / "t.csv", steps=1)
    assert users.records == []
    rows = read_telemetry(tmp_path / "t.csv")
    casts = [r for r in rows if r["kind"] == "cast"]
    assert len(casts) == 27 and all(r["note"] == AS_IF_CAST for r in casts)
    assert max(r["flushed_fraction"] for r in casts) > 0.2  # what FP8 would do to it
    assert said == []


def test_a_loss_spike_warns(tmp_path):
    telemetry = Telemetry(torch.nn.Linear(2, 2), None, tmp_path / "t.csv", log=None)
    for step in range(1, 12):
        telemetry.loss(step, 2.0 - 0.01 * step)
    telemetry.loss(12, 3.0)
    telemetry.close()
    (warning,) = [r for r in read_telemetry(tmp_path / "t.csv") if r["kind"] == "warning"]
    assert (warning["step"], warning["site"], warning["role"]) == (12, "loss", "loss_spike")

"""Early warnings: each kind raised past its threshold, once per site until it recovers, kept
across a checkpoint; and the per-site health summary of a run's rows."""
from __future__ import annotations

from ipu_unit_scaling.training.run_health import (
    HealthMonitor,
    TelemetryConfig,
    format_health_table,
    run_health,
)


def _cast(step, site="l.input", flushed=0.0, saturated=0.0, scale=0, rms=1.0, fmt="F143"):
    return dict(step=step, kind="cast", site=site, role="activation", format=fmt,
                log2_scale=scale, amax=2.0, rms=rms, flushed_fraction=flushed,
                saturated_fraction=saturated, sqnr_db=30.0 - step, note="")


def _param(step, site, ratio, role="hidden"):
    return dict(step=step, kind="param", site=site, role=role, update_ratio=ratio)


def _kinds(warnings):
    return [(w["step"], w["site"], w["role"]) for w in warnings]


def test_each_kind_past_its_threshold():
    monitor = HealthMonitor(TelemetryConfig())
    rows = [_cast(1, "a", flushed=0.3), _cast(1, "b", saturated=0.01),
            _cast(1, "c", scale=31), _cast(1, "d", rms=200.0),  # F143's max is 240
            _cast(1, "e", flushed=0.1, saturated=0.0005, rms=50.0),  # all under
            dict(step=1, kind="attention", site="att", role="logit", amax=150.0)]
    rows += [_param(1, f"w{i}", 0.01) for i in range(4)] + [_param(1, "big", 0.5)]
    rows += [_param(1, "odd", 0.2), _param(1, "n1", 0.001, "norm")]
    found = _kinds(monitor.check(rows))
    assert sorted(found) == sorted([(1, "a", "flushed"), (1, "b", "saturated"), (1, "c", "range"),
                                    (1, "d", "range"), (1, "att", "attention_logit"),
                                    (1, "big", "update_ratio"), (1, "odd", "update_ratio")])


def test_once_per_site_and_kind_until_it_recovers_and_kept_in_a_checkpoint():
    monitor = HealthMonitor(TelemetryConfig())
    assert _kinds(monitor.check([_cast(1, flushed=0.5)])) == [(1, "l.input", "flushed")]
    assert monitor.check([_cast(2, flushed=0.6)]) == []
    state = monitor.state_dict()
    resumed = HealthMonitor(TelemetryConfig())
    resumed.load_state_dict(state)
    assert resumed.check([_cast(3, flushed=0.6)]) == []
    assert resumed.check([_cast(4, flushed=0.0)]) == []  # recovered
    assert _kinds(resumed.check([_cast(5, flushed=0.5)])) == [(5, "l.input", "flushed")]


def test_a_loss_spike_after_ten_steps_and_a_nan_loss():
    monitor = HealthMonitor(TelemetryConfig(loss_spike=0.5))
    loss = lambda step, value: dict(step=step, kind="loss", site="loss", amax=value)  # noqa
    assert [w for s in range(1, 11) for w in monitor.check([loss(s, 2.0)])] == []
    assert monitor.check([loss(11, 2.9)]) == []  # 45% above: under 50%
    assert _kinds(monitor.check([loss(12, 3.2)])) == [(12, "loss", "loss_spike")]
    monitor = HealthMonitor(TelemetryConfig())
    assert _kinds(monitor.check([loss(1, float("nan"))])) == [(1, "loss", "loss_spike")]


def test_the_summary_of_a_run():
    rows = [_cast(1, flushed=0.01, scale=-1), _cast(2, flushed=0.03, scale=2),
            _cast(3, flushed=0.02, saturated=0.001, scale=0),
            dict(step=2, kind="attention", site="att", role="logit", amax=4.0),
            dict(step=3, kind="attention", site="att", role="logit", amax=3.0),
            dict(step=3, kind="warning", site="l.input", role="flushed", note="warning: ...")]
    health = run_health(rows)
    (site,) = health["sites"]
    assert (site["worst_flushed"], site["worst_flushed_step"]) == (0.03, 2)
    assert (site["worst_saturated"], site["worst_saturated_step"]) == (0.001, 3)
    assert (site["log2_scale_min"], site["log2_scale_max"]) == (-1, 2)
    assert (site["sqnr_db_min"], site["sqnr_db_last"]) == (27.0, 27.0)
    assert health["attention"] == [dict(site="att", largest_logit=4.0, step=2)]
    assert health["warnings"] == [dict(step=3, site="l.input", kind="flushed",
                                       message="warning: ...")]
    assert health["sampled_steps"] == [1, 2, 3]
    table = format_health_table(health)
    assert "3.00% (2)" in table and "-1..2" in table and table.endswith("warning: ...")


def test_a_nonfinite_cast_warns_and_an_exact_one_does_not():
    monitor = HealthMonitor(TelemetryConfig())
    rows = [_cast(1, "a"), _cast(1, "b"), _cast(1, "c"), _cast(1, "d")]
    rows[0]["amax"] = float("nan")
    rows[1]["sqnr_db"] = -float("inf")  # finite values became NaN or inf
    rows[2]["sqnr_db"] = float("inf")  # an exact cast
    rows[3]["note"] = "as if cast: the run is not FP8"
    rows[3]["flushed_fraction"] = float("nan")
    assert sorted(_kinds(monitor.check(rows))) == [(1, "a", "nonfinite"), (1, "b", "nonfinite")]
    health = run_health(rows)
    assert [(w["site"], w["kind"]) for w in health["warnings"]] == [
        ("a", "nonfinite"), ("b", "nonfinite")]
    assert health["as_if_cast"] is True
    by_site = {s["site"]: s for s in health["sites"]}
    assert by_site["c"]["sqnr_db_min"] == float("inf") and by_site["c"]["nonfinite"] == []
    assert by_site["b"]["sqnr_db_min"] == -float("inf")


def test_the_thresholds_know_the_recipe():
    """What a recipe's scales do by design warns of nothing: a group recipe's RMS near the
    format's top, mx's and nvfp4's scales past +-31, mx's (floor rule) and nvfp4's saturated
    top binade. Under a per-tensor recipe the same rows warn."""
    from ipu_unit_scaling.fp8 import FP8Config

    def rows():  # (E4M3FN's max is 448)
        return [_cast(1, "sat", saturated=0.009, fmt="E4M3FN"),
                _cast(1, "top", rms=300.0, fmt="E4M3FN"), _cast(1, "clamp", scale=31)]

    def kinds(fp8):
        return sorted(_kinds(HealthMonitor(TelemetryConfig(), fp8).check(rows())))

    everything = [(1, "clamp", "range"), (1, "sat", "saturated"), (1, "top", "range")]
    assert kinds(None) == kinds(FP8Config(scaling="amax")) == everything
    assert kinds(FP8Config(scaling="delayed")) == everything
    assert kinds(FP8Config(scaling="block")) == [(1, "clamp", "range"), (1, "sat", "saturated")]
    assert kinds(FP8Config(scaling="rowwise")) == [(1, "clamp", "range"),
                                                   (1, "sat", "saturated")]
    assert kinds(FP8Config.from_recipe("mx")) == []
    assert kinds(FP8Config.from_recipe("nvfp4")) == []
    # mx rounding its scales up leaves no value past the top: saturation there warns
    assert kinds(FP8Config.from_recipe("mx_round_up")) == [(1, "sat", "saturated")]
    # FP4 elements flush the values of a group far below its largest by design; FP8 ones warn
    monitor = HealthMonitor(TelemetryConfig(), FP8Config.from_recipe("nvfp4"))
    flushing = [_cast(1, "fp4", flushed=0.24, fmt="E2M1"), _cast(1, "fp8", flushed=0.24)]
    assert _kinds(monitor.check(flushing)) == [(1, "fp8", "flushed")]

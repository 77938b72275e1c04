"""``ipu-unit-scaling health``: the table and the JSON document of a run, the inspector with
--params, and bad input in one line with nothing changed."""
from __future__ import annotations

import json

import pytest
from helpers import one_line_error, run, run_files, train_args

from ipu_unit_scaling.apps.health import inspect_main


@pytest.fixture
def trained(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    status, _, err = run(capsys, *train_args(run_dir, data, "training.steps=4",
                                                     "telemetry.interval=2"))
    assert status == 0, err
    return run_dir


def test_table_and_json(trained, capsys):
    status, out, _ = run(capsys, "health", trained)
    assert status == 0
    assert out.splitlines()[0] == f"{trained}: completed"
    assert "3 sampled steps (1..4)" in out and "layers.0.attn.qkv.grad_output" in out
    status, out, _ = run(capsys, "health", trained, "--json")
    document = json.loads(out)
    assert status == 0 and document["telemetry"] and document["sampled_steps"] == [1, 2, 4]
    assert isinstance(document["warnings"], list)
    assert {s["role"] for s in document["sites"]} == {"activation", "weight", "gradient"}


def test_warnings_in_the_json_have_step_site_and_kind(capsys, tmp_path, data):
    run_dir = tmp_path / "plain"
    # a plain model under static FP8: its gradients flush from the first step
    status, _, err = run(capsys, *train_args(
        run_dir, data, "training.steps=2", "model.unit_scaled=false",
        "precision.fp8.scaling=static", "training.learning_rate=0.006"))
    assert status == 0, err
    document = json.loads(run(capsys, "health", run_dir, "--json")[1])
    assert document["warnings"], document
    for warning in document["warnings"]:
        assert set(warning) >= {"step", "site", "kind"} and warning["step"] == 1


def test_params(trained, capsys):
    status, out, _ = run(capsys, "health", trained, "--params")
    assert status == 0
    head = [line for line in out.splitlines() if "parameters at step" in line]
    assert head and head[0].startswith("16 parameters at step 4")


def test_a_run_without_telemetry_is_told_in_one_line(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=2",
                                            "telemetry.interval=0"))[0] == 0
    status, out, _ = run(capsys, "health", run_dir)
    assert status == 0 and out.count("\n") == 1 and "recorded no telemetry" in out


@pytest.mark.parametrize("make", ["missing", "file", "empty", "compare", "damaged"])
def test_bad_input_is_one_line_and_changes_nothing(make, trained, capsys, tmp_path):
    target = {"missing": tmp_path / "none", "file": tmp_path / "f.txt",
              "empty": tmp_path / "empty", "compare": tmp_path / "cmp",
              "damaged": trained}[make]
    if make == "file":
        target.write_text("x")
    elif make in ("empty", "compare"):
        target.mkdir()
        if make == "compare":
            (target / "compare.md").write_text("# compare\n")
    elif make == "damaged":
        with open(target / "telemetry.csv", "a") as handle:
            handle.write("2,cast,x\n")
    before = run_files(target) if target.is_dir() else None
    status, out, err = run(capsys, "health", target)
    assert status != 0 and out == "" and one_line_error(err), err
    if before is not None:
        assert run_files(target) == before


def test_the_inspector_on_a_config(capsys):
    assert inspect_main(["--config", "tiny", "--set", "model.parametrization=u-mup"]) == 0
    out = capsys.readouterr().out
    assert "u-mup" in out.splitlines()[0] and "0 flagged" in out.splitlines()[0]
    assert inspect_main(["--set", "telemetry.interval=-1"]) == 2
    assert "telemetry.interval" in capsys.readouterr().err


def test_a_bad_threshold_is_refused_before_a_directory_is_made(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    status, _, err = run(capsys, *train_args(run_dir, data,
                                                     "telemetry.flushed_warning=2"))
    assert status == 2 and one_line_error(err) and "telemetry.flushed_warning" in err
    assert not run_dir.exists()


def test_the_compare_table_has_a_health_column(trained):
    from ipu_unit_scaling.apps.compare import format_compare_table
    from ipu_unit_scaling.apps.health import health_summary

    summary = health_summary(trained)
    assert summary["warnings"] == 0 and 0 <= summary["worst_flushed"] < 0.1
    row = dict(regime="unit-fp8", model="unit", precision="fp8 amax", learning_rate=0.06,
               status="completed", steps=4, final_val_loss=2.0, elapsed_s=1.0, health=summary)
    table = format_compare_table([row], None)
    assert "| health |" in table.splitlines()[0]
    assert f"flushed {summary['worst_flushed']:.1%} / saturated 0.0%, 0 warnings" in table
    assert health_summary(trained.parent)["warnings"] is None  # no telemetry: "-"

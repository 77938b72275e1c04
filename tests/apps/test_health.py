"""``ipu-unit-scaling health``: the table and the JSON document of a run, the inspector with
--params, and bad input in one line with nothing changed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT, one_line_error, run, run_files, train_args

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
    # the CLI's rule (docs/guide/cli.md): a bad run directory or file is a usage error, 2
    assert status == 2 and out == "" and one_line_error(err), err
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


def test_the_health_guide_states_the_cli_exit_status():
    guide = (ROOT / "docs" / "guide" / "health.md").read_text()
    assert "exit status 2" in guide and "exit status 1" not in guide


def test_params_json_holds_the_inspector_rows(trained, capsys):
    status, out, _ = run(capsys, "health", trained, "--params", "--json")
    plain = json.loads(run(capsys, "health", trained, "--json")[1])
    document = json.loads(out)
    assert status == 0 and "inspector" not in plain
    inspector = document.pop("inspector")
    assert document == plain
    assert inspector["step"] == 4 and inspector["flagged"] == 0
    rows = inspector["parameters"]
    assert len(rows) == 16 and rows[0]["name"] == "embedding.weight"
    for row in rows:
        assert set(row) >= {"name", "role", "lr_mult", "rule_mult", "init_std",
                            "learning_rate", "update_ratio", "flags"}
        assert isinstance(row["update_ratio"], float)  # measured over the run's sampled steps


def _edit_cast_cells(run_dir, step, site, **cells):
    from ipu_unit_scaling.training.telemetry_log import TELEMETRY_FIELDS

    path = run_dir / "telemetry.csv"
    lines = path.read_text().split("\n")
    for number, line in enumerate(lines):
        if line.startswith(f"{step},cast,{site},"):
            values = line.split(",")
            for name, value in cells.items():
                values[TELEMETRY_FIELDS.index(name)] = value
            lines[number] = ",".join(values)
    path.write_text("\n".join(lines))


def test_a_nonfinite_value_is_reported_per_site_and_warns(trained, capsys):
    site = "layers.0.attn.qkv.input"
    _edit_cast_cells(trained, 2, site, flushed_fraction="nan")
    _edit_cast_cells(trained, 4, "layers.0.attn.qkv.weight", amax="nan", sqnr_db="-inf")
    status, out, _ = run(capsys, "health", trained)
    assert status == 0
    row = next(line for line in out.splitlines() if line.startswith(site + " "))
    assert "flushed_fraction nan (2)" in row
    assert f"warning: step 2: {site}: flushed_fraction is nan" in out
    assert "warning: step 4: layers.0.attn.qkv.weight: amax is nan, sqnr_db is -inf" in out
    document = json.loads(run(capsys, "health", trained, "--json")[1])
    (entry,) = [s for s in document["sites"] if s["site"] == site]
    assert entry["nonfinite"] == [dict(field="flushed_fraction", value="nan", step=2)]
    assert [(w["step"], w["site"], w["kind"]) for w in document["warnings"]] == [
        (2, site, "nonfinite"), (4, "layers.0.attn.qkv.weight", "nonfinite")]


def test_a_telemetry_file_cut_mid_row_says_what_is_missing(trained, capsys):
    path = trained / "telemetry.csv"
    whole = path.read_bytes()
    path.write_bytes(whole[:-20])  # within the last row, of step 4
    status, out, _ = run(capsys, "health", trained)
    assert status == 0 and out.splitlines()[0] == f"{trained}: completed"
    assert "warning: telemetry.csv ends in a row of step 4 cut short" in out
    assert "3 sampled steps (1..4)" in out  # what is there is still reported
    document = json.loads(run(capsys, "health", trained, "--json")[1])
    assert len(document["problems"]) == 1 and "step 4" in document["problems"][0]
    path.write_bytes(whole)
    assert json.loads(run(capsys, "health", trained, "--json")[1])["problems"] == []


def test_a_damaged_summary_is_named(trained, capsys):
    (trained / "summary.json").write_text('{"status": "compl')
    status, out, _ = run(capsys, "health", trained)
    assert status == 0
    assert out.splitlines()[0] == f"{trained}: unknown (summary.json is damaged)"
    assert "running or killed" not in out and "warning: summary.json is damaged" in out


def test_a_run_without_fp8_says_its_casts_are_as_if(capsys, tmp_path, data):
    run_dir = tmp_path / "fp32"
    assert run(capsys, *train_args(run_dir, data, "training.steps=2",
                                   "precision.dtype=fp32"))[0] == 0
    status, out, _ = run(capsys, "health", run_dir)
    assert status == 0 and "as if cast: the run is not FP8" in out.splitlines()[2]
    document = json.loads(run(capsys, "health", run_dir, "--json")[1])
    assert document["as_if_cast"] is True
    assert {s["note"] for s in document["sites"]} == {"as if cast: the run is not FP8"}


@pytest.mark.parametrize("step", ["-5", "0", "6", "100000"])
def test_the_inspector_refuses_a_step_outside_the_schedule(step, capsys):
    assert inspect_main(["--config", "tiny", "--step", step]) == 2  # tiny trains 5 steps
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "give 1 to 5" in err, err


def test_the_inspector_labels_the_step_whose_rate_it_shows(capsys):
    from ipu_unit_scaling.apps.health import inspect_parameters_of
    from ipu_unit_scaling.training.run_config import load_config, scheduled_learning_rate

    config = load_config("tiny", ["training.warmup_steps=4"])
    for step in (1, 4, 5):
        inspection = inspect_parameters_of(config, step)
        assert inspection["step"] == step
        assert inspection["learning_rate"] == scheduled_learning_rate(config.training, step - 1)
    assert inspect_parameters_of(config)["step"] == 4  # the first at the peak rate
    assert inspect_main(["--config", "tiny", "--step", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 5


def test_the_inspector_is_silent_when_its_reader_leaves():
    process = subprocess.Popen(
        [sys.executable, "-m", "ipu_unit_scaling.apps.health", "--config", "tiny"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None
    process.stdout.close()  # gone before anything is written: '| head' on a slow start
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0 and err == b"", err.decode()

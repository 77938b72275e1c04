"""The ``ipu-unit-scaling`` command end to end on the tiny config."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from helpers import ONE_IPU as FAST
from helpers import ROOT, as_a_foreground_job, run

import ipu_unit_scaling
from ipu_unit_scaling.apps.cli import build_parser, main
from ipu_unit_scaling.training.config_names import REGIMES
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics


def losses(run_dir: Path, column: str = "train_loss") -> List[str]:
    return [row[column] for row in read_metrics(run_dir)]


def test_help_is_complete(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for word in ("train", "compare", "analyse", "Exit status"):
        assert word in text
    options = {
        "train": ("--config", "--set", "--data", "--run-dir", "--resume", "--quiet",
                  "--scale-report", "--threads"),
        "compare": ("--config", "--set", "--data", "--regimes", "--run-dir", "--quiet"),
        "analyse": ("--config", "--set", "--run-dir"),
    }
    for command, flags in options.items():
        assert main([command, "--help"]) == 0
        text = capsys.readouterr().out
        assert all(flag in text for flag in flags), command


def test_train_writes_every_artefact_and_the_loss_goes_down(capsys, tmp_path):
    run_dir = tmp_path / "run"
    status, out, _ = run(
        capsys, "train", "--config", "tiny", "--run-dir", run_dir, "--set",
        "training.steps=40", "training.learning_rate=0.03", "training.warmup_steps=5",
        "training.eval_interval=20", "training.log_interval=10",
    )
    assert status == 0
    for name in ("config.yaml", "tokenizer.json", "metrics.csv", "summary.json", "loss.png",
                 "checkpoint.pt"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    train_losses = [float(v) for v in losses(run_dir)]
    assert len(train_losses) == 40
    assert sum(train_losses[-5:]) / 5 < sum(train_losses[:5]) / 5 - 0.5
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert [step for step, _ in summary["val_curve"]] == [20, 40]
    assert summary["final_val_loss"] < summary["val_curve"][0][1]
    assert re.search(r"final validation loss [\d.]+ .*unigram baseline [\d.]+", out)
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 40


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _train_process(*argv: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "ipu_unit_scaling.apps.cli", "train", *argv],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=as_a_foreground_job,
    )


def test_resume_after_sigkill_repeats_the_uninterrupted_losses_bit_for_bit(capsys, tmp_path):
    settings = ["--set", *FAST, "training.steps=60", "training.checkpoint_interval=5",
                "training.eval_interval=10", "training.learning_rate=0.01"]
    reference = tmp_path / "reference"
    assert run(capsys, "train", "--config", "tiny", "--run-dir", reference, "--quiet",
               *settings)[0] == 0

    killed = tmp_path / "killed"
    process = _train_process("--config", "tiny", "--run-dir", str(killed), "--quiet", *settings)
    try:
        _wait_for(killed / "checkpoint.pt", process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    stopped_at = load_checkpoint(killed / "checkpoint.pt")["step"]
    assert 5 <= stopped_at < 60

    status, _, err = run(capsys, "train", "--resume", killed, "--quiet")
    assert status == 0, err
    assert losses(killed) == losses(reference)  # exact strings of the float values
    assert losses(killed, "val_loss") == losses(reference, "val_loss")
    assert [r["step"] for r in read_metrics(killed)] == [str(s) for s in range(1, 61)]


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    process = _train_process("--config", "tiny", "--run-dir", str(run_dir), "--set", *FAST,
                             "training.steps=100000", "training.checkpoint_interval=3")
    try:
        _wait_for(run_dir / "checkpoint.pt", process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130
    step = load_checkpoint(run_dir / "checkpoint.pt")["step"]
    assert f"interrupted at step {step}; checkpoint: {run_dir / 'checkpoint.pt'}" in err
    assert "Traceback" not in err
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(capsys, tmp_path):
    run_dir = tmp_path / "run"
    assert run(capsys, "train", "--config", "tiny", "--run-dir", run_dir, "--quiet",
               "--set", *FAST, "training.steps=4")[0] == 0
    checkpoint = run_dir / "checkpoint.pt"
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()

    # Continue with a learning rate that blows the weights up after one step.
    status, _, err = run(capsys, "train", "--resume", run_dir, "--quiet", "--set",
                         "training.steps=20", "training.learning_rate=1e30",
                         "training.checkpoint_interval=1")
    assert status == 1
    match = re.fullmatch(
        r"ipu-unit-scaling: (?:validation )?loss became nan at step (\d+)[^;]*; "
        r"last good checkpoint: (\S+)\n", err
    )
    assert match, err
    assert 5 <= int(match.group(1)) <= 20 and match.group(2) == str(checkpoint)
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == digest
    state = load_checkpoint(checkpoint)
    assert state["step"] == 4
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "diverged"


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    (b"", "is empty"),
    (b"\xff\xfe binary", "not UTF-8"),
    (b"too short", "too short for one sequence"),
])
def test_bad_data_exits_2_with_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_bytes(content)
    status, _, err = run(capsys, "train", "--config", "tiny", "--data", path,
                         "--run-dir", tmp_path / "run")
    assert status == 2
    assert err.startswith("ipu-unit-scaling: error: ") and err.count("\n") == 1
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "no-such-config"], "not found"),
    (["train", "--set", "training.stpes=3"], "did you mean 'steps'"),
    (["train", "--set", "training.steps=0"], "training.steps"),
    (["train", "--set", "model.heads=3"], "must divide"),
    (["train", "--resume", "nowhere"], "cannot resume nowhere"),
    (["train", "--resume", "nowhere", "--config", "tiny"], "--resume continues a run"),
])
def test_bad_configs_exit_2_with_one_line(capsys, tmp_path, argv, message):
    status, _, err = run(capsys, *argv, "--run-dir", tmp_path / "run") if "--resume" not in \
        argv else run(capsys, *argv)
    assert status == 2
    assert err.startswith("ipu-unit-scaling: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize("argv, words", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["compare", "--regimes", "fp7"], "invalid choice: 'fp7'"),
    (["train", "--threads", "0"], "expected a positive integer"),
    (["train", "--threads", "100000"], "at most 1024"),
    (["train", "--set"], "expected at least one argument"),
    ([], "no command; use 'ipu-unit-scaling train' to train the default config"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, words):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("ipu-unit-scaling: error: ") and captured.err.count("\n") == 1
    assert words in captured.err and captured.out == ""


def test_existing_run_dir_is_not_overwritten(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    status, _, err = run(capsys, "train", "--config", "tiny", "--run-dir", tmp_path / "run")
    assert status == 2 and "not empty" in err
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"


def test_compare_runs_every_regime_and_writes_table_and_png(capsys, tmp_path):
    run_dir = tmp_path / "compare"
    status, out, _ = run(capsys, "compare", "--config", "tiny", "--run-dir", run_dir,
                         "--quiet", "--set", *FAST, "training.steps=3")
    assert status == 0
    table_rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table_rows[1:]] == list(REGIMES)
    assert (run_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((run_dir / "compare.json").read_text())
    rows = {row["regime"]: row for row in data["regimes"]}
    assert set(rows) == set(REGIMES)
    assert rows["fp32"]["gap_to_fp32_percent"] == 0.0
    for regime, row in rows.items():
        assert row["status"] == "completed", regime
        gap = 100 * (row["final_val_loss"] / rows["fp32"]["final_val_loss"] - 1)
        assert row["gap_to_fp32_percent"] == pytest.approx(gap)
        assert (run_dir / regime / "metrics.csv").is_file()

    # Rerunning the same directory reuses the finished regimes.
    status, out, _ = run(capsys, "compare", "--config", "tiny", "--run-dir", run_dir,
                         "--regimes", "fp32", "unit-fp8", "--set", *FAST, "training.steps=3")
    # (and the finished regimes the directory holds besides them stay in its table)
    assert status == 0 and out.count("reusing the finished run") == len(REGIMES)
    table = (run_dir / "compare.md").read_text()
    assert all(f"| {regime} |" in table for regime in REGIMES)


def test_scale_report_and_analyse_write_their_files(capsys, tmp_path):
    status, _, _ = run(capsys, "train", "--config", "tiny", "--run-dir", tmp_path / "run",
                       "--quiet", "--scale-report", "2", "--set", *FAST, "training.steps=4")
    assert status == 0
    steps = {row.split(",")[0] for row in
             (tmp_path / "run" / "scale_report.csv").read_text().splitlines()[1:]}
    assert steps == {"2", "4"}
    status, out, _ = run(capsys, "analyse", "--config", "tiny", "--run-dir", tmp_path / "scales")
    assert status == 0 and "unit-scaled" in out and "plain" in out
    assert (tmp_path / "scales" / "scales.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "scales" / "scales.txt").read_text()  # the table it printed
    assert table.split()[:2] == ["model", "op"] and table.strip() in out
    assert str(tmp_path / "scales" / "scales.txt") in out


def test_compare_bert_trains_every_regime_and_seed(tmp_path, capsys):
    from ipu_unit_scaling.apps.cli import main

    status = main(["compare", "--model", "bert", "--regimes", "fp32", "unit-fp8", "--seeds",
                   "2", "--set", "mlm.steps=10", "mlm.hidden_size=32", "mlm.depth=1",
                   "mlm.eval_interval=5", "mlm.eval_batches=1", "--run-dir", str(tmp_path),
                   "--quiet"])
    out = capsys.readouterr().out
    assert status == 0
    assert "| unit-fp8 | unit-scaled | fp8 static |" in out and "seeds 0, 1" in out
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "fp32-seed0", "fp32-seed1", "unit-fp8-seed0", "unit-fp8-seed1"]


@pytest.mark.parametrize("arguments,message", [
    (["--model", "bert", "--config", "tiny"], "not --config"),
    (["--model", "bert", "--set", "mlm.stepz=3"], "not an mlm setting"),
    (["--seeds", "0"], "expected a positive integer"),
])
def test_compare_bert_arguments_are_checked(arguments, message, capsys):
    from ipu_unit_scaling.apps.cli import main

    assert main(["compare", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_compare_help_describes_every_regime_it_accepts(capsys):
    assert main(["compare", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    described = text.split("Regimes: ", 1)[1].split(". Each regime's", 1)[0]
    for regime in REGIMES:
        assert f"{regime} (" in described, regime

    from ipu_unit_scaling.apps.cli import REGIME_HELP
    from ipu_unit_scaling.training.precision import REGIME_SETTINGS

    assert set(REGIME_HELP) == set(REGIME_SETTINGS) == set(REGIMES)


def _saved_figures(monkeypatch) -> List[Dict[str, Any]]:
    """What each figure saved holds: its tick labels, and whether the tight bounding box of
    everything drawn (matplotlib's, in inches) lies within the figure."""
    from matplotlib.figure import Figure

    saved: List[Dict[str, Any]] = []
    save = Figure.savefig

    def record(self, *args, **kwargs):
        self.canvas.draw()
        tight = self.get_tightbbox(self.canvas.get_renderer())
        inside = self.bbox_inches.padded(0.01)
        saved.append({
            "yticklabels": [[t.get_text() for t in axes.get_yticklabels()] for axes in self.axes],
            "inside": inside.contains(tight.x0, tight.y0) and inside.contains(tight.x1, tight.y1),
            "bounds": (tight.bounds, self.bbox_inches.bounds),
        })
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def test_scales_png_shows_whole_op_names_inside_the_figure(tmp_path, monkeypatch):
    from ipu_unit_scaling.analysis import plot_scales
    from ipu_unit_scaling.analysis.tracking import ScaleRecord

    ops = ["embedding", "layers.0.attn.scaled_dot_product_attention",
           "layers.11.attn.scaled_dot_product_attention", "layers.11.mlp.down", "head"]
    records = {model: [ScaleRecord(index, op, "activation", 2.0 ** -index, 1.0, 4)
                       for index, op in enumerate(ops)] for model in ("plain", "unit-scaled")}
    saved = _saved_figures(monkeypatch)
    plot_scales(records, tmp_path / "scales.png")
    assert (tmp_path / "scales.png").read_bytes()[:4] == b"\x89PNG"
    (figure,) = saved
    assert figure["yticklabels"][:2] == [ops, ops]
    assert figure["inside"], figure["bounds"]


def test_analyse_table_keeps_the_layer_of_every_op():
    from ipu_unit_scaling.analysis import worst_table
    from ipu_unit_scaling.analysis.tracking import ScaleRecord

    ops = ["layers.0.attn.scaled_dot_product_attention",
           "layers.11.attn.scaled_dot_product_attention"]
    records = {"unit-scaled": [ScaleRecord(i, op, "activation", 0.5, 1.0, 4, {"F143": 0.0})
                               for i, op in enumerate(ops)]}
    rows = worst_table(records, formats=("F143",)).splitlines()[2:]
    assert [row.split()[1] for row in rows] == ops


@pytest.mark.parametrize("loss", [0.002, 3.0, 1234.0, 123456.0, 1e30])
def test_loss_figures_keep_their_labels_inside(tmp_path, monkeypatch, loss):
    from ipu_unit_scaling.training.plots import plot_compare, plot_run

    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,lr,train_loss,val_loss,tokens_per_s,elapsed_s\n" + "".join(
        f"{step},0.1,{loss * 3 / step},{loss * 2 / step if step % 10 == 0 else ''},1,1\n"
        for step in range(1, 50)))
    saved = _saved_figures(monkeypatch)
    plot_run(metrics, tmp_path / "loss.png", 3.2, "title")
    plot_compare({"fp32": [(1, loss * 12), (2, loss)], "umup-fp8-amax": [(1, 3.0)]},
                 tmp_path / "compare.png", 3.0)
    assert len(saved) == 2
    for figure in saved:
        assert figure["inside"], figure["bounds"]


@pytest.mark.parametrize("command", ["compare", "sweep"])
def test_help_in_an_ascii_terminal_escapes_what_it_cannot_show(command):
    result = subprocess.run(
        [sys.executable, "-m", "ipu_unit_scaling.apps.cli", command, "--help"], cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONIOENCODING="ascii"),
        capture_output=True, timeout=120,
    )
    assert result.returncode == 0 and b"Traceback" not in result.stderr, result.stderr
    assert b"u-\\u03bcP" in result.stdout  # u-\u03bcP, escaped


# The bare command and ``--version``: what a user types first.


def _subcommands() -> list:
    (subparsers,) = [action for action in build_parser()._actions
                     if isinstance(action, argparse._SubParsersAction)]
    return list(subparsers.choices)


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"ipu-unit-scaling {ipu_unit_scaling.__version__}\n"
    assert captured.err == ""
    assert re.fullmatch(r"\d+\.\d+\.\d+", ipu_unit_scaling.__version__)


def test_the_package_declares_the_version_the_command_prints():
    declared = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split()
    assert declared[-1] == ipu_unit_scaling.__version__


def test_bare_command_hint_names_every_subcommand(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    hint = captured.err.partition("--help' for ")[2]
    named = set(re.findall(r"[a-z]+", hint))
    missing = [command for command in _subcommands() if command not in named]
    assert not missing, f"the hint leaves out {missing}: {hint}"

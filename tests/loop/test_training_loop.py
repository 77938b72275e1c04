"""How a run stops and goes on: SIGTERM, resumes that extend or lack a checkpoint, the clock of a
resumed run, and divergence of a finite loss."""
from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
import torch
from helpers import FAST, ROOT, one_line_error, run, train_args
from helpers import run_files as contents

from ipu_unit_scaling.apps.pretrained import evaluate_run, open_run
from ipu_unit_scaling.loop import run_opening
from ipu_unit_scaling.loop.run_outcomes import divergence_bound
from ipu_unit_scaling.loop.run_session import TrainingSession
from ipu_unit_scaling.training.run_config import load_config, scheduled_learning_rate
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics


def column(run_dir: Path, name: str) -> List[str]:
    return [row[name] for row in read_metrics(run_dir)]


# ------------------------------------------------------------------------------ SIGTERM


def test_sigterm_saves_at_the_step_boundary_and_the_resume_goes_on_from_there(capsys, tmp_path,
                                                                                 data):
    # A constant learning rate, so that the run can be continued to any length and compared
    # with one that ran that length at once; no checkpoint but the one SIGTERM asks for.
    settings = ["training.schedule=constant", "training.warmup_steps=0",
                "training.learning_rate=0.01", "training.eval_interval=0",
                "training.checkpoint_interval=0"]
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "ipu_unit_scaling.apps.cli",
         *train_args(run_dir, data, *settings, "training.steps=100000")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.csv").is_file() or len(read_metrics(run_dir)) < 3:
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the run never reached step 3"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, err
    step = load_checkpoint(run_dir / "checkpoint.pt")["step"]
    assert step >= 3 and len(read_metrics(run_dir)) == step
    assert f"SIGTERM: interrupted at step {step}; checkpoint: {run_dir / 'checkpoint.pt'}" in err
    assert "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["checkpoint_step"] == step

    total = step + 3
    status, out, err = run(capsys, "train", "--resume", run_dir, "--set",
                           f"training.steps={total}")
    assert status == 0, err
    assert f"resuming {run_dir} at step {step} of {total}" in out
    reference = tmp_path / "reference"
    assert run(capsys, *train_args(reference, data, *settings, f"training.steps={total}"))[0] == 0
    assert column(run_dir, "step") == [str(s) for s in range(1, total + 1)]
    assert column(run_dir, "train_loss") == column(reference, "train_loss")
    assert column(run_dir, "val_loss") == column(reference, "val_loss")


def test_sigterm_stops_compare_at_a_step_boundary_and_compare_resumes(capsys, tmp_path, data,
                                                                      monkeypatch):
    argv = ["compare", "--config", "tiny", "--data", data, "--quiet", "--regimes", "fp32",
            "unit-fp32", "--set", *FAST, "training.steps=6", "training.checkpoint_interval=0"]
    reference = tmp_path / "reference"
    assert run(capsys, *argv, "--run-dir", reference)[0] == 0

    real_call = TrainingSession.train_call
    calls = []

    def call_then_terminate(self, inputs, labels):
        calls.append(self.step)
        if len(calls) == 9:  # the third step of the second regime
            os.kill(os.getpid(), signal.SIGTERM)
        return real_call(self, inputs, labels)

    monkeypatch.setattr(TrainingSession, "train_call", call_then_terminate)
    # Should the command not handle SIGTERM, this one takes it, not the test process.
    escaped = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: escaped.append(signum))
    stopped = tmp_path / "stopped"
    try:
        status, _, err = run(capsys, *argv, "--run-dir", stopped)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not escaped
    assert status == 128 + signal.SIGTERM, err
    assert "SIGTERM: interrupted at step 3" in err
    assert load_checkpoint(stopped / "unit-fp32" / "checkpoint.pt")["step"] == 3
    monkeypatch.undo()

    assert run(capsys, *argv, "--run-dir", stopped)[0] == 0
    for regime in ("fp32", "unit-fp32"):
        assert column(stopped / regime, "train_loss") == column(reference / regime, "train_loss")
        assert column(stopped / regime, "val_loss") == column(reference / regime, "val_loss")


def test_the_default_checkpoint_interval_bounds_the_steps_a_kill_loses():
    config = load_config()
    assert 0 < config.training.checkpoint_interval <= config.training.steps // 5
    # A checkpoint on an evaluation step reuses the evaluation that vouches for it.
    assert config.training.checkpoint_interval % config.training.eval_interval == 0


# ------------------------------------------------------------------- a missing checkpoint


def test_a_finished_run_without_its_checkpoint_is_refused_and_left_alone(capsys, finished, data):
    (finished / "checkpoint.pt").unlink()
    before = contents(finished)
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet")
    assert status == 2 and one_line_error(err), err
    assert "checkpoint.pt is missing" in err and "completed run of 4 steps" in err
    assert contents(finished) == before
    # Nor may a new run in that directory start afresh over it.
    status, _, err = run(capsys, *train_args(finished, data, "training.steps=4"))
    assert status == 2 and one_line_error(err), err
    assert "checkpoint.pt is missing" in err
    assert contents(finished) == before


def test_a_run_killed_after_a_checkpoint_is_refused_once_the_checkpoint_is_gone(
        capsys, tmp_path, data, monkeypatch):
    real_log = TrainingSession.log_step

    def die_at_step_3(self, lr, loss, val_loss):
        real_log(self, lr, loss, val_loss)
        if self.step == 3:  # as a second Ctrl-C would: at once, no summary written after it
            raise KeyboardInterrupt

    monkeypatch.setattr(TrainingSession, "log_step", die_at_step_3)
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=6",
                                   "training.checkpoint_interval=2"))[0] == 130
    monkeypatch.undo()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "unfinished" and summary["checkpoint_step"] == 2
    (run_dir / "checkpoint.pt").unlink()
    before = contents(run_dir)
    status, _, err = run(capsys, "train", "--resume", run_dir, "--quiet")
    assert status == 2 and one_line_error(err) and "checkpoint at step 2" in err, err
    assert contents(run_dir) == before


def test_a_run_that_never_saved_a_checkpoint_may_start_afresh(capsys, tmp_path, data):
    # It diverged at once, before its first checkpoint: its summary says it saved none.
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=4",
                                   "training.learning_rate=1e6"))[0] == 1
    assert json.loads((run_dir / "summary.json").read_text())["checkpoint_step"] is None
    assert not (run_dir / "checkpoint.pt").exists()
    status, out, err = run(capsys, "train", "--resume", run_dir, "--set",
                           "training.learning_rate=0.01")
    assert status == 0, err
    assert "never saved one; training from step 0" in out
    assert column(run_dir, "step") == ["1", "2", "3", "4"]


# ------------------------------------------------------------------ resuming: time, schedule


def test_a_resumed_run_counts_its_time_on_from_the_checkpoint(capsys, tmp_path, data,
                                                              monkeypatch):
    real_call = TrainingSession.train_call

    def slow_call(self, inputs, labels):
        time.sleep(0.25)
        return real_call(self, inputs, labels)

    monkeypatch.setattr(TrainingSession, "train_call", slow_call)
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=4",
                                   "training.checkpoint_interval=2"))[0] == 0
    monkeypatch.undo()
    before = [float(v) for v in column(run_dir, "elapsed_s")]
    assert before[-1] >= 1.0

    # Resuming the finished run with its own steps: the summary keeps the run's time.
    status, out, _ = run(capsys, "train", "--resume", run_dir)
    assert status == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["elapsed_s"] >= before[-1]
    assert f"4 steps in {summary['elapsed_s']:.1f} s" in out

    # Training on: the new rows count on from the checkpoint's time.
    assert run(capsys, "train", "--resume", run_dir, "--quiet", "--set",
               "training.steps=6")[0] == 0
    after = [float(v) for v in column(run_dir, "elapsed_s")]
    assert after[:4] == before and after == sorted(after) and after[4] >= before[-1]
    assert json.loads((run_dir / "summary.json").read_text())["elapsed_s"] >= after[-1]


def test_extending_a_finished_run_says_what_the_learning_rate_does(capsys, finished):
    old = load_config("tiny", FAST + ["training.steps=4"]).training
    new = load_config("tiny", FAST + ["training.steps=8"]).training
    was, now = scheduled_learning_rate(old, 4), scheduled_learning_rate(new, 4)
    assert was == 0.0 and now > 0.0  # the cosine had ended; the longer one has not

    status, out, _ = run(capsys, "train", "--resume", finished, "--set", "training.steps=8")
    assert status == 0
    notes = [line for line in out.splitlines() if "learning-rate schedule" in line]
    assert len(notes) == 1, out
    note = notes[0]
    assert "training.steps 4 -> 8" in note
    assert f"from step 5 the learning rate follows the new one, {now:.3g} where the old one " \
           f"gives {was:.3g}" in note
    assert "the old schedule had ended" in note and "the loss may rise" in note
    lrs = [float(v) for v in column(finished, "lr")]
    assert lrs[4:] == [scheduled_learning_rate(new, step) for step in range(4, 8)]


def test_a_resume_with_the_same_schedule_says_nothing_of_it(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=6",
                                   "training.checkpoint_interval=2"))[0] == 0
    (run_dir / "summary.json").unlink()
    status, out, _ = run(capsys, "train", "--resume", run_dir)
    assert status == 0 and "learning-rate schedule" not in out


# ------------------------------------------------------------------------------ divergence


def test_the_divergence_bound_is_ten_nats_above_the_uniform_baseline():
    assert divergence_bound(256) == pytest.approx(math.log(256) + 10.0)
    assert divergence_bound(2) == pytest.approx(math.log(2) + 10.0)


def test_a_finite_exploding_loss_is_divergence_not_completion(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    status, _, err = run(capsys, *train_args(run_dir, data, "training.steps=40",
                                             "training.learning_rate=300"))
    assert status == 1, err
    assert "more than 10 nats above the uniform baseline" in err and "Traceback" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] < 40
    bound = divergence_bound(len(json.loads((run_dir / "tokenizer.json").read_text())["chars"]))
    losses = [float(v) for v in column(run_dir, "train_loss")]
    assert losses[-1] > bound and all(loss <= bound for loss in losses[:-1])


def test_the_last_good_checkpoint_holds_weights_whose_loss_is_sane(capsys, finished):
    checkpoint = finished / "checkpoint.pt"
    digest = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    # Each step's weights are checkpointed, and one step at this rate ruins them while they
    # stay finite: the loss logged for a step is that of the weights before its update.
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                         "training.steps=20", "training.learning_rate=1e6",
                         "training.checkpoint_interval=1")
    assert status == 1, err
    assert f"last good checkpoint: {checkpoint}" in err
    assert hashlib.sha256(checkpoint.read_bytes()).hexdigest() == digest
    assert json.loads((finished / "summary.json").read_text())["status"] == "diverged"

    trained = open_run(finished)
    loss = evaluate_run(trained, [trained.precision], backend="cpu").rows[0].loss
    assert loss <= divergence_bound(trained.config.model.vocab_size)
    assert loss < math.log(trained.config.model.vocab_size)  # it had learned something
    assert all(torch.isfinite(t).all() for t in load_checkpoint(checkpoint)["model"].values())


def test_a_run_diverged_before_any_checkpoint_names_none(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    status, _, err = run(capsys, *train_args(run_dir, data, "training.steps=20",
                                             "training.learning_rate=1e6",
                                             "training.checkpoint_interval=1"))
    assert status == 1 and err.rstrip().endswith("last good checkpoint: none"), err
    assert not (run_dir / "checkpoint.pt").exists()


def test_sigterm_before_the_training_loop_stops_the_command_like_ctrl_c(capsys, tmp_path, data,
                                                                        monkeypatch):
    def terminated_while_loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return "memory checked"

    monkeypatch.setattr(run_opening, "check_memory", terminated_while_loading)
    escaped: List[int] = []

    def handler(signum, frame):
        escaped.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        status, _, err = run(capsys, *train_args(tmp_path / "run", data, "training.steps=4"))
        assert signal.getsignal(signal.SIGTERM) is handler  # the command put it back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not escaped
    assert status == 128 + signal.SIGTERM and err == "ipu-unit-scaling: SIGTERM\n", err


# ------------------------------------------------------------------------------ refused resumes


def test_a_resume_refused_for_a_model_that_does_not_fit_changes_nothing(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=4",
                                   "training.checkpoint_interval=2"))[0] == 0
    before = contents(run_dir)
    status, _, err = run(capsys, "train", "--resume", run_dir, "--set",
                         "model.hidden_size=64", "training.steps=6")
    assert status == 2 and one_line_error(err) and "does not fit" in err, err
    assert contents(run_dir) == before
    # and the run still goes on with its own settings
    status, _, err = run(capsys, "train", "--resume", run_dir, "--set", "training.steps=6")
    assert status == 0, err
    assert len(column(run_dir, "train_loss")) == 6

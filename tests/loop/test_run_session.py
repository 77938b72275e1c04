"""Telemetry in the training loop: recorded on every backend with the same columns, exactly
once per sampled step across a kill and a resume, in TensorBoard, drawn in health.png, and a
learning rate far too high warned of before the validation loss shows it."""
from __future__ import annotations

import csv
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List

import pytest
from helpers import ONE_IPU, run

from ipu_unit_scaling.loop.run_outcomes import TrainingDiverged
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics, save_checkpoint
from ipu_unit_scaling.training.telemetry_log import read_telemetry

SHORT = [*ONE_IPU, "training.eval_batches=1", "training.steps=6", "training.eval_interval=2",
         "training.checkpoint_interval=2", "telemetry.interval=2"]


def _config(data: Path, *overrides: str) -> Config:
    config = load_config("tiny", [*SHORT, *overrides])
    return replace(config, data=replace(config.data, path=str(data)))


def _rows(run_dir: Path) -> List[Dict[str, Any]]:
    return [{k: v for k, v in row.items()} for row in
            csv.DictReader(open(run_dir / "telemetry.csv", newline=""))]


def test_telemetry_is_on_by_default_and_off_at_interval_0(data, tmp_path):
    train(_config(data), tmp_path / "on", quiet=True)
    rows = read_telemetry(tmp_path / "on" / "telemetry.csv")
    assert sorted({r["step"] for r in rows}) == [1, 2, 4, 6]
    assert {r["kind"] for r in rows} == {"cast", "param", "attention"}
    assert (tmp_path / "on" / "health.png").stat().st_size > 0
    train(_config(data, "telemetry.interval=0"), tmp_path / "off", quiet=True)
    assert not (tmp_path / "off" / "telemetry.csv").exists()
    assert not (tmp_path / "off" / "health.png").exists()


_KILLER = """
import os, signal, sys
from dataclasses import replace
import torch
from pathlib import Path
from ipu_unit_scaling.loop.run_session import TrainingSession
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.run_config import load_config

real_log = TrainingSession.log_step

def log_then_die(self, lr, loss, val_loss):
    real_log(self, lr, loss, val_loss)
    if self.step == int(sys.argv[2]):
        os.kill(os.getpid(), signal.SIGKILL)

TrainingSession.log_step = log_then_die
torch.set_num_threads(int(sys.argv[4]))
config = load_config("tiny", sys.argv[5:])
config = replace(config, data=replace(config.data, path=sys.argv[3]))
train(config, Path(sys.argv[1]), quiet=True)
"""


def _killed_after_step(overrides: List[str], data: Path, run_dir: Path, step: int) -> None:
    """Train in a new process that SIGKILLs itself once the metrics row of ``step`` is
    written (a new process, not a fork: a fork of a process that has run torch's threads can
    hang), on this process's thread count (another count sums in another order)."""
    import torch

    done = subprocess.run([sys.executable, "-c", _KILLER, str(run_dir), str(step), str(data),
                           str(torch.get_num_threads()), *overrides], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr


def test_a_killed_and_resumed_run_has_each_sampled_step_once(data, tmp_path, capsys):
    overrides = [*SHORT, "training.checkpoint_interval=4"]
    train(_config(data, *overrides), tmp_path / "reference", quiet=True)
    killed = tmp_path / "killed"
    _killed_after_step(overrides, data, killed, 5)  # checkpoint at 4; step 5's rows are lost work
    assert load_checkpoint(killed / "checkpoint.pt")["step"] == 4
    assert max(r["step"] for r in read_telemetry(killed / "telemetry.csv")) == 4
    # health and the figure read a killed run
    status, out, err = run(capsys, "health", killed)
    assert status == 0 and "sampled steps (1..4)" in out, err
    from ipu_unit_scaling.training.health_plot import plot_health

    assert plot_health(killed / "telemetry.csv", tmp_path / "killed.png").stat().st_size > 0

    train(None, killed, resume=True, quiet=True)
    keys = [(r["step"], r["kind"], r["site"]) for r in _rows(killed)]
    assert len(keys) == len(set(keys))
    # On CPU a resumed run is the uninterrupted one, bit for bit: so is its telemetry.
    assert _rows(killed) == _rows(tmp_path / "reference")
    assert len(read_metrics(killed)) == 6


def test_tensorboard_gets_the_telemetry(data, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(_config(data), tmp_path / "run", quiet=True)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"),
                              size_guidance={"scalars": 0, "histograms": 0}).Reload()
    scalars = events.Tags()["scalars"]
    assert "telemetry/layers.0.attn.qkv.grad_output/flushed_fraction" in scalars
    assert "telemetry/head.weight/update_ratio" in scalars
    assert "telemetry/layers.1.attn/largest_logit" in scalars
    assert [e.step for e in events.Scalars("telemetry/head.input/sqnr_db")] == [1, 2, 4, 6]
    assert {"telemetry/scaling_bias", "telemetry/log10_update_ratio"} <= \
        set(events.Tags()["histograms"])


def test_the_emulator_records_the_cpu_backends_rows(data, tmp_path):
    runs = {}
    for backend in ("cpu", "emulator"):
        train(_config(data, f"backend={backend}", "training.steps=2"), tmp_path / backend,
              quiet=True)
        runs[backend] = {(r["step"], r["kind"], r["site"]): r
                         for r in read_telemetry(tmp_path / backend / "telemetry.csv")}
    cpu, emulator = runs["cpu"], runs["emulator"]
    assert list(cpu) == list(emulator)
    for key, row in cpu.items():
        if key[0] != 1:  # later steps follow weights the IPU's numerics changed
            continue
        other = emulator[key]
        assert (other["role"], other["format"]) == (row["role"], row["format"])
        # Step 1: the same weights and batch; the IPU's GELU (tanh form) and its casts'
        # rounding move activations and gradients by far less than 5%.
        for name in ("amax", "rms", "weight_rms", "grad_rms", "update_rms"):
            if row[name] == row[name]:  # not NaN
                assert other[name] == pytest.approx(row[name], rel=0.05), (key, name)


def test_a_learning_rate_far_too_high_warns_before_the_validation_loss_moves(data, tmp_path):
    common = ["training.steps=6", "training.warmup_steps=8", "training.eval_interval=1",
              "telemetry.interval=8"]
    healthy = train(_config(data, *common), tmp_path / "ok", quiet=True)
    said: List[str] = []
    try:  # it diverges within the run, or finishes far worse
        train(_config(data, *common, "training.learning_rate=6.0"), tmp_path / "bad",
              log=said.append, progress=False)
    except TrainingDiverged:
        pass
    moved = [step for (step, loss), (_, good) in zip(
        [(int(r["step"]), float(r["val_loss"])) for r in read_metrics(tmp_path / "bad")
         if r["val_loss"]], healthy.val_curve) if loss > 1.05 * good]
    warned = [int(line.split(": ")[1].split()[1]) for line in said if "warning:" in line]
    assert warned and moved and min(warned) < moved[0], (warned, moved)
    assert any("update/weight ratio" in line for line in said)


def _history_keys(run_dir: Path) -> Dict[str, Any]:
    model = load_checkpoint(run_dir / "checkpoint.pt")["model"]
    return {key: value for key, value in model.items() if key.endswith("amax_history")}


def test_fine_tuning_crosses_fp8_recipes_and_resuming_stays_strict(data, tmp_path, capsys):
    def train_cli(run_dir: Path, *arguments: str) -> int:
        return run(capsys, "train", *arguments, "--run-dir", run_dir, "--quiet", "--set",
                   *ONE_IPU, "training.eval_batches=1", "training.steps=2",
                   "training.eval_interval=2")[0]

    delayed = ["precision.dtype=fp8", "precision.fp8.scaling=delayed"]
    assert train_cli(tmp_path / "delayed", "--config", "tiny", "--data", data, "--set",
                     *delayed) == 0
    pretrained = _history_keys(tmp_path / "delayed")
    assert pretrained and all(bool(h.abs().sum() > 0) for h in pretrained.values())
    for name, precision in [("rowwise", ["precision.dtype=fp8", "precision.fp8.scaling=rowwise"]),
                            ("fp32", ["precision.dtype=fp32"]),
                            ("delayed_longer", [*delayed, "precision.fp8.amax_history_length=4"])]:
        assert train_cli(tmp_path / name, "--init-from", tmp_path / "delayed", "--data", data,
                         "--set", *precision) == 0, name
        histories = _history_keys(tmp_path / name)
        assert set(histories) == (set() if name in ("rowwise", "fp32") else set(pretrained))
        assert all(history.shape[1] == 4 for history in histories.values())
    # and back into delayed from a run without histories: they start fresh (all zero), then fill
    assert train_cli(tmp_path / "back", "--init-from", tmp_path / "rowwise", "--data", data,
                     "--set", *delayed) == 0
    assert set(_history_keys(tmp_path / "back")) == set(pretrained)
    # a resumed run is the same run: a checkpoint without its history is refused, not refilled
    state = load_checkpoint(tmp_path / "back" / "checkpoint.pt")
    key = sorted(pretrained)[0]
    del state["model"][key]
    save_checkpoint(tmp_path / "back" / "checkpoint.pt", state)
    status, _, err = run(capsys, "train", "--resume", tmp_path / "back", "--quiet", "--set",
                         "training.steps=3")
    assert status != 0 and key in err

"""The run directory under torchrun (2 processes on gloo): rank 0 alone reads and writes it,
on a resume too, and speaks for the run: why it stopped is said once, by rank 0, whichever
rank met it, and the summary records it.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from helpers import (
    DATA_PARALLEL,
    FP32,
    finish,
    needs_gloo,
    needs_pipelining,
    tiny_train_arguments,
    torchrun,
    train_in_process,
    wait_for_rows,
    worker_of_rank,
)

from ipu_unit_scaling.apps.pretrained import open_run
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = needs_gloo

# helpers.DATA_PARALLEL, shortened.
DP = [s for s in DATA_PARALLEL if not s.startswith(("training.steps", "training.eval_interval",
                                                    "training.checkpoint_interval"))]


def _run_torchrun(arguments):
    process = torchrun(arguments)
    output = finish(process)
    return process.returncode, output


@pytest.mark.parametrize("layout", [
    pytest.param("pipelined", marks=needs_pipelining), "data-parallel"])
def test_a_resume_under_torchrun_keeps_every_row_and_the_run_readable(layout, word_text, tmp_path):
    # A run of 4 steps, checkpointed at 2 and 4; resumed under torchrun to 8 steps. Every rank
    # rewriting metrics.csv on resume lost the rows rank 0 appended after another rank's
    # rename, and the directory was refused from then on.
    settings = ([] if layout == "pipelined" else DP) + [
        FP32, "training.steps=4", "training.checkpoint_interval=2", "training.eval_interval=2"]
    run_dir = tmp_path / "run"
    train_in_process(word_text, run_dir, settings)
    status, output = _run_torchrun(["train", "--resume", str(run_dir), "--quiet", "--set",
                                    "training.steps=8"])
    assert status == 0, output[-3000:]
    assert [int(row["step"]) for row in read_metrics(run_dir)] == list(range(1, 9))
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 8
    assert open_run(run_dir).step == 8  # evaluate and sample read it
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["backend"] == "distributed"
    assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def _said_once(output: str, words: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("ipu-unit-scaling:")]
    assert len(lines) == 1 and words in lines[0], output[-3000:]
    return lines[0]


@pytest.mark.parametrize("layout", [
    pytest.param("pipelined", marks=needs_pipelining), "data-parallel"])
def test_divergence_under_torchrun_is_said_once_and_recorded(layout, word_text, tmp_path):
    # In FP8 with this learning rate a cast meets a non-finite value at step 2: on one
    # pipeline stage alone (the other then sees a connection closed), or on every replica.
    run_dir = tmp_path / "run"
    settings = ([] if layout == "pipelined" else DP) + [
        "training.steps=6", "training.learning_rate=1e6", "training.checkpoint_interval=2"]
    status, output = _run_torchrun(tiny_train_arguments(word_text, run_dir, settings))
    assert status != 0
    line = _said_once(output, "loss became")
    # (torchrun's own log may name the SIGTERM it sends a rank still running)
    for noise in ("Connection", "Failed to run stage", "internal error"):
        assert noise not in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["message"] in line


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_sigint_to_rank_zero_is_reported_as_sigint_with_the_way_on(word_text, tmp_path):
    run_dir = tmp_path / "run"
    settings = DP + ["training.steps=400", "training.checkpoint_interval=100",
                     "training.eval_interval=100"]
    launcher = torchrun(tiny_train_arguments(word_text, run_dir, settings))
    try:
        wait_for_rows(run_dir, 2, [launcher])
        os.kill(worker_of_rank(launcher, 0), signal.SIGINT)
    finally:
        output = finish(launcher)
    assert launcher.returncode != 0
    line = _said_once(output, "SIGINT: interrupted at step")
    assert f"continue with: ipu-unit-scaling train --resume {run_dir}" in line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == summary["steps"]

"""``ipu-unit-scaling train`` under torchrun: the distributed backend, 2 processes on gloo (CPU).

Runs go through ``python -m torch.distributed.run ... -m ipu_unit_scaling train``, or, where a
test must reach one rank (a signal, another argument), through processes started with the
environment torchrun gives its workers.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
from helpers import (
    DATA_PARALLEL,
    FP32,
    ROOT,
    finish,
    kill_session,
    metric_rows,
    needs_gloo,
    needs_pipelining,
    tiny_train_arguments,
    torchrun,
    torchrun_environment,
    train_in_process,
    wait_for_rows,
    worker_of_rank,
)
from helpers import DATA_PARALLEL_STEPS as STEPS

from ipu_unit_scaling.backends import BACKEND_ENV, BackendError, select_backend
from ipu_unit_scaling.backends.distributed import check_launch
from ipu_unit_scaling.training.run_config import load_config, scheduled_learning_rate
from ipu_unit_scaling.training.run_directory import RunLock
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = needs_gloo


def _torchrun_ok(arguments: Sequence[str], processes: int = 2) -> str:
    process = torchrun(arguments, processes)
    output = finish(process)
    assert process.returncode == 0, output[-4000:]
    return output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ranks(arguments: Sequence[Sequence[str]]) -> List[subprocess.Popen]:
    """One process per rank, each with its own arguments, in torchrun's worker environment."""
    port, world = str(_free_port()), str(len(arguments))
    return [subprocess.Popen(
        [sys.executable, "-m", "ipu_unit_scaling", *argv], cwd=ROOT,
        env=torchrun_environment(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world,
                         LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank, argv in enumerate(arguments)]


def _finish_ranks(ranks: Sequence[subprocess.Popen]) -> List[Tuple[str, str]]:
    try:
        return [p.communicate(timeout=240) for p in ranks]
    finally:
        for process in ranks:
            kill_session(process)


def _rows(run_dir: Path) -> List[Dict[str, str]]:
    return [{key: row[key] for key in ("step", "lr", "train_loss", "val_loss")}
            for row in read_metrics(run_dir)]


def _assert_close_rows(got: List[Dict[str, str]], expected: List[Dict[str, str]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    assert [r["lr"] for r in got] == [r["lr"] for r in expected]
    for key in ("train_loss", "val_loss"):
        assert [r[key] == "" for r in got] == [r[key] == "" for r in expected]
        assert [float(r[key]) for r in got if r[key]] == pytest.approx(
            [float(r[key]) for r in expected if r[key]], abs=1e-5, rel=0)


@pytest.fixture(scope="module")
def data_parallel_run(word_text, tmp_path_factory) -> Path:
    """A 2-process data-parallel run, uninterrupted, launched with torchrun."""
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    _torchrun_ok(tiny_train_arguments(word_text, run_dir, DATA_PARALLEL))
    return run_dir


def test_data_parallel_run_has_the_losses_of_one_process(data_parallel_run, word_text, tmp_path):
    single = train_in_process(word_text, tmp_path / "single", DATA_PARALLEL)
    _assert_close_rows(_rows(data_parallel_run), _rows(single))
    # The schedule is that of training.steps.
    training = load_config("tiny", DATA_PARALLEL).training
    assert [float(r["lr"]) for r in _rows(data_parallel_run)] == \
        [scheduled_learning_rate(training, step) for step in range(STEPS)]
    summary = json.loads((data_parallel_run / "summary.json").read_text())
    assert summary["backend"] == "distributed" and summary["status"] == "completed"
    assert summary["steps"] == STEPS and summary["checkpoint_step"] == STEPS
    assert sorted(p.name for p in data_parallel_run.iterdir()) == sorted(
        p.name for p in single.iterdir())


def test_evaluate_and_sample_read_a_distributed_run(data_parallel_run, tmp_path, capsys):
    from ipu_unit_scaling.apps.cli import main

    summary = json.loads((data_parallel_run / "summary.json").read_text())
    assert main(["evaluate", str(data_parallel_run), "--precision", "fp32", "fp8-amax",
                 "--out", str(tmp_path), "--quiet"]) == 0
    rows = json.loads((tmp_path / "evaluate.json").read_text())["rows"]
    losses = {row["precision"]: row["loss"] for row in rows}
    # Its own precision gives the run's final validation loss.
    assert losses["fp32"] == pytest.approx(summary["final_val_loss"], abs=1e-6)
    assert math.isfinite(losses["fp8-amax"])
    capsys.readouterr()
    assert main(["sample", str(data_parallel_run), "--tokens", "40", "--prompt", "the "]) == 0
    written = capsys.readouterr().out
    assert written.startswith("the ") and len(written.rstrip("\n")) >= 40

    # A run that named the backend reads alike: evaluation and sampling take one process.
    named = tmp_path / "named"
    shutil.copytree(data_parallel_run, named)
    config = (named / "config.yaml").read_text()
    assert "\nbackend: auto\n" in config
    (named / "config.yaml").write_text(config.replace("\nbackend: auto\n",
                                                      "\nbackend: distributed\n"))
    assert main(["sample", str(named), "--tokens", "40", "--prompt", "the "]) == 0
    assert capsys.readouterr().out == written


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")
def test_sigkill_of_one_rank_then_resume_continues_bit_for_bit(data_parallel_run, word_text,
                                                               tmp_path):
    run_dir = tmp_path / "killed"
    launcher = torchrun(tiny_train_arguments(word_text, run_dir, DATA_PARALLEL))
    try:
        wait_for_rows(run_dir, 6, [launcher])  # past the checkpoint of step 4
        rank0, rank1 = worker_of_rank(launcher, 0), worker_of_rank(launcher, 1)
        os.kill(rank0, signal.SIGSTOP)  # (holds the run where it is)
        assert metric_rows(run_dir) < STEPS
        os.kill(rank1, signal.SIGKILL)
        os.kill(rank0, signal.SIGCONT)
    finally:
        finish(launcher)
    assert launcher.returncode != 0
    saved = load_checkpoint(run_dir / "checkpoint.pt")["step"]
    assert 4 <= saved < STEPS

    _torchrun_ok(["train", "--resume", str(run_dir), "--quiet"])
    assert _rows(run_dir) == _rows(data_parallel_run)
    resumed = load_checkpoint(run_dir / "checkpoint.pt")["model"]
    uninterrupted = load_checkpoint(data_parallel_run / "checkpoint.pt")["model"]
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_sigterm_on_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(
        data_parallel_run, word_text, tmp_path):
    """Rank 1, given its own --run-dir, never touches it: rank 0 alone writes the run."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "rank1-dir"
    ranks = _ranks([tiny_train_arguments(word_text, run_dir, DATA_PARALLEL),
                    tiny_train_arguments(word_text, elsewhere, DATA_PARALLEL)])
    try:
        wait_for_rows(run_dir, 2, ranks)
        ranks[0].send_signal(signal.SIGSTOP)  # (holds the run where it is)
        assert metric_rows(run_dir) < STEPS - 2  # room for the stop to be agreed on
        ranks[1].send_signal(signal.SIGTERM)
        ranks[0].send_signal(signal.SIGCONT)
    finally:
        outputs = _finish_ranks(ranks)
    # (rank 0 speaks for the run, and its status is the run's: the others end with 0)
    assert [p.returncode for p in ranks] == [143, 0], outputs
    summary = json.loads((run_dir / "summary.json").read_text())
    step = summary["steps"]
    assert summary["status"] == "interrupted" and summary["checkpoint_step"] == step < STEPS
    assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == step
    assert metric_rows(run_dir) == step
    assert f"SIGTERM: interrupted at step {step}; checkpoint:" in outputs[0][1]
    assert outputs[1][0] == "" and outputs[1][1] == ""  # rank 0 speaks for the run
    assert not elsewhere.exists()

    # It resumes on one process, with the losses of the uninterrupted run.
    from ipu_unit_scaling.loop.training_loop import train

    train(None, run_dir, resume=True, quiet=True)
    _assert_close_rows(_rows(run_dir), _rows(data_parallel_run))


def test_a_run_in_use_is_refused_on_every_rank(data_parallel_run):
    checkpoint = (data_parallel_run / "checkpoint.pt").read_bytes()
    arguments = ["train", "--resume", str(data_parallel_run), "--set", "training.steps=16"]
    with RunLock(data_parallel_run, shared=True):  # as evaluate holds it
        ranks = _ranks([arguments, arguments])
        outputs = _finish_ranks(ranks)
    assert [p.returncode for p in ranks] == [2, 0], outputs
    errors = outputs[0][1].strip().splitlines()
    assert len(errors) == 1 and "is in use by" in errors[0], outputs[0]
    assert outputs[1][1] == ""
    assert (data_parallel_run / "checkpoint.pt").read_bytes() == checkpoint


PIPELINED = ["training.schedule=constant", "training.warmup_steps=0", "training.grad_clip=0.5",
             "training.eval_interval=2", "training.checkpoint_interval=2", FP32]


@needs_pipelining
def test_pipelined_run_has_the_losses_of_one_process_and_resumes_without_torchrun(
        word_text, tmp_path):
    """configs/tiny.yaml's two stages on two processes; its checkpoint (weights and Adam state
    gathered from both stages) continues on one process as if it had never been split."""
    from ipu_unit_scaling.loop.training_loop import train

    run_dir = tmp_path / "pipelined"
    _torchrun_ok(tiny_train_arguments(word_text, run_dir, PIPELINED + ["training.steps=4"]))
    assert json.loads((run_dir / "summary.json").read_text())["backend"] == "distributed"
    train(None, run_dir, resume=True, overrides=["training.steps=8"], quiet=True)
    single = train_in_process(word_text, tmp_path / "single", PIPELINED + ["training.steps=8"])
    _assert_close_rows(_rows(run_dir), _rows(single))


def test_backend_under_torchrun(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    replicated = load_config("tiny", DATA_PARALLEL)
    with pytest.raises(BackendError, match="runs under torchrun"):
        select_backend("distributed", replicated)
    assert select_backend("distributed", training=False) == "cpu"  # evaluate, sample

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert select_backend("auto", replicated) == "distributed"
    assert select_backend("distributed", replicated) == "distributed"
    assert select_backend("auto", training=False) == "cpu"
    with pytest.raises(BackendError, match="torchrun started 2 processes, but backend 'cpu'"):
        select_backend("cpu", replicated)
    with pytest.raises(BackendError, match=r"= 1 x 1 = 1: launch --nproc-per-node 1 or set "
                                           r"ipu.replication_factor=2$"):
        select_backend("auto", load_config("tiny", ["ipu.ipus_per_replica=1",
                                                    "ipu.layers_per_ipu=[-1]"]))


def test_pipelined_config_without_pipelining_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "torch.distributed.pipelining", None)  # as torch 2.0.1
    with pytest.raises(BackendError) as refused:
        check_launch(load_config("tiny").ipu)  # two stages
    message = str(refused.value)
    assert "\n" not in message and "needs torch.distributed.pipelining" in message
    assert f"missing from torch {torch.__version__}" in message
    assert "(ipu.ipus_per_replica=1 ipu.layers_per_ipu=[-1])" in message


def test_only_train_runs_under_torchrun(monkeypatch, capsys, tmp_path):
    from ipu_unit_scaling.apps.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["evaluate", str(tmp_path)]) == 2
    assert "evaluate runs in one process" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    assert main(["evaluate", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ""  # rank 0 says it
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--scale-report", "--run-dir", str(tmp_path / "r")]) == 2
    assert "scale report is recorded by one process" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()

"""The training loop's scalars in TensorBoard event files, read back with TensorBoard's own
reader; and no tensorboard/ directory where TensorBoard does not import."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
from helpers import ONE_IPU

from ipu_unit_scaling.loop.run_session import TrainingSession
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.run_config import load_config
from ipu_unit_scaling.training.run_records import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def config(data: Path):
    return load_config("tiny", [
        *ONE_IPU, "training.steps=6", "training.checkpoint_interval=2", "training.eval_interval=3",
        "training.eval_batches=1", f"data.path={data}"])


def scalars(run_dir: Path) -> Dict[str, List[Tuple[int, float]]]:
    """Every scalar's (step, value) points, as TensorBoard shows them."""
    accumulator_module = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    accumulator = accumulator_module.EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={accumulator_module.SCALARS: 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def column(run_dir: Path, name: str) -> List[Tuple[int, float]]:
    """The column of metrics.csv as TensorBoard stores it: float32, on the steps it has."""
    return [(int(row["step"]), float(np.float32(float(row[name]))))
            for row in read_metrics(run_dir) if row[name]]


def test_the_event_files_hold_the_metrics(config, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    run_dir = tmp_path / "run"
    train(config, run_dir, quiet=True)
    found = {tag: values for tag, values in scalars(run_dir).items()
             if not tag.startswith("telemetry/")}  # (the telemetry's: tests/loop)
    assert set(found) == {"train/loss", "train/lr", "train/tokens_per_s", "val/loss"}
    assert found["train/loss"] == column(run_dir, "train_loss")
    assert found["train/lr"] == column(run_dir, "lr")
    assert found["val/loss"] == column(run_dir, "val_loss")
    assert [step for step, _ in found["val/loss"]] == [3, 6]
    assert [step for step, _ in found["train/tokens_per_s"]] == list(range(1, 7))


def test_a_resumed_run_shows_each_step_once(config, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    if not hasattr(os, "fork"):
        pytest.skip("kills a forked child")
    run_dir = tmp_path / "run"
    pid = os.fork()
    if pid == 0:  # killed after the row of step 3, past the checkpoint of step 2
        try:
            real_log = TrainingSession.log_step

            def log_then_die(self, lr, loss, val_loss):  # type: ignore[no-untyped-def]
                real_log(self, lr, loss, val_loss)
                if self.step == 3:
                    self.tensorboard.flush()  # what the killed process logged is on disk
                    os.kill(os.getpid(), signal.SIGKILL)

            TrainingSession.log_step = log_then_die  # type: ignore[method-assign]
            train(config, run_dir, quiet=True)
        finally:
            os._exit(70)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert [step for step, _ in scalars(run_dir)["train/loss"]] == [1, 2, 3]
    train(None, run_dir, resume=True, quiet=True)
    found = scalars(run_dir)
    assert found["train/loss"] == column(run_dir, "train_loss")  # step 3 once: the resume's
    assert found["val/loss"] == column(run_dir, "val_loss")


def test_without_tensorboard_the_run_writes_no_event_files(config, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    run_dir = tmp_path / "run"
    summary = train(config, run_dir, quiet=True)
    assert summary.status == "completed"
    assert not (run_dir / "tensorboard").exists()


def test_a_resume_in_the_same_second_still_writes_the_file_read_last(tmp_path):
    """TensorBoard reads event files in name order, and names start with the second they were
    made in: the resume's file must sort after the killed process's even then."""
    pytest.importorskip("torch.utils.tensorboard")
    from ipu_unit_scaling.training.tensorboard_log import TensorBoardLog

    log_dir = tmp_path / "tensorboard"
    log_dir.mkdir()
    # An earlier process's file of this very second, on a host whose name sorts last.
    earlier = log_dir / f"events.out.tfevents.{int(time.time()):010d}.~host.99999.0"
    earlier.write_bytes(b"")
    log = TensorBoardLog(tmp_path, step=2)
    log.log(3, {"train/loss": 1.0})
    log.close()
    assert sorted(p.name for p in log_dir.iterdir())[0] == earlier.name

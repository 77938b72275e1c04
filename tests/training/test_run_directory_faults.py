"""Kills at chosen and random moments, and concurrent writers, against a run directory.

Every ``train`` here runs in a forked child of the test process (the package is imported once,
so a run takes a fraction of a second) and dies by SIGKILL: from outside at a random moment,
or from inside at a chosen point of an artefact write (before its first byte, half-way through
it, after its fsync, after its rename). Afterwards the directory must either resume to the
uninterrupted run's losses bit for bit, or refuse in one line and then start again cleanly.
"""
from __future__ import annotations

import gc
import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import yaml
from helpers import ONE_IPU, TEXT

import ipu_unit_scaling.training.plots  # noqa: F401  (imported before forking: children start warm)
from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or not Path("/proc/self/fd").is_dir(),
    reason="forks children and reads /proc/self/fd (Linux)",
)

SETTINGS = [*ONE_IPU,
            "training.eval_batches=1", "training.steps=6", "training.checkpoint_interval=2",
            "training.eval_interval=3"]
ARTEFACT = re.compile(r"^\.?(.+?)(\.[A-Za-z0-9_]{8}\.tmp)?$")


def _target(name: str, temporary_suffix: bool) -> str:
    """The artefact a file descriptor or path belongs to: ``metrics.csv+`` for appends."""
    base = os.path.basename(name)
    match = ARTEFACT.match(base)
    artefact = match.group(1) if match else base
    return artefact if temporary_suffix or base != "metrics.csv" else "metrics.csv+"


def _fd_target(fd: int) -> str:
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
    if os.path.isdir(name):
        return "<directory>"  # the fsync that makes a rename durable
    return _target(name, name.endswith(".tmp"))


class Recorder:
    """Wraps os.write, os.fsync and os.replace in a child: records each call as
    (operation, artefact, occurrence), and dies by SIGKILL at the chosen one."""

    def __init__(self, log: Optional[Path], fault: Optional[Tuple[str, str, int, str]]) -> None:
        self.log, self.fault = log, fault
        self.counts: Dict[Tuple[str, str], int] = {}
        self.real = (os.write, os.fsync, os.replace)

    def install(self) -> None:
        real_write, real_fsync, real_replace = self.real

        def write(fd: int, data: Any) -> int:
            event = self._event("write", _fd_target(fd))
            if event == "before":
                self._die()
            if event == "half":
                real_write(fd, bytes(data)[: max(1, len(data) // 2)])
                self._die()
            return real_write(fd, data)

        def fsync(fd: int) -> None:
            target = _fd_target(fd)
            real_fsync(fd)
            if self._event("fsync", target) == "after":
                self._die()

        def replace(src: Any, dst: Any) -> None:
            target = _target(str(dst), True)
            real_replace(src, dst)
            if self._event("replace", target) == "after":
                self._die()

        os.write, os.fsync, os.replace = write, fsync, replace  # type: ignore[assignment]

    def _event(self, operation: str, target: str) -> Optional[str]:
        key = (operation, target)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.log is not None:
            with open(self.log, "a") as handle:
                handle.write(f"{operation} {target} {self.counts[key]}\n")
        if self.fault and self.fault[:3] == (operation, target, self.counts[key]):
            return self.fault[3]
        return None

    @staticmethod
    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def _child(argv: List[str], err: Path, prepare: Optional[Callable[[], None]] = None) -> int:
    """Fork; the child runs the command with stderr into ``err``; returns the child's pid."""
    pid = os.fork()
    if pid:
        return pid
    gc.freeze()  # the collector leaves the parent's objects alone: no copy of their pages
    status = 70
    try:
        descriptor = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(descriptor, 2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        sys.stderr = open(2, "w", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        if prepare is not None:
            prepare()
        status = main(argv)
    except BaseException:  # what escapes main is a bug the test must see
        import traceback

        traceback.print_exc()
        status = 71
    finally:
        sys.stderr.flush()
        os._exit(status)


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _run(argv: List[str], err: Path, prepare: Optional[Callable[[], None]] = None) -> int:
    return _wait(_child(argv, err, prepare))


def _kill_after(pid: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    return _wait(pid)


def _train(run_dir: Path, data: Path, *extra: str) -> List[str]:
    return ["train", "--config", "tiny", "--data", str(data), "--run-dir", str(run_dir),
            "--quiet", "--set", *SETTINGS, *extra]


def _resume(run_dir: Path) -> List[str]:
    return ["train", "--resume", str(run_dir), "--quiet"]


def _losses(run_dir: Path) -> List[Tuple[str, str, str]]:
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run_dir)]


def _settings(run_dir: Path) -> Any:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


class Reference:
    def __init__(self, run_dir: Path, seconds: float, events: List[Tuple[str, str, int]]):
        self.run_dir, self.seconds, self.events = run_dir, seconds, events
        self.losses = _losses(run_dir)
        self.settings = _settings(run_dir)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: Any) -> Tuple[Path, Reference]:
    root = tmp_path_factory.mktemp("faults")
    data = root / "text.txt"
    data.write_text(TEXT)
    # One run in this process first, so that every child starts with the lazy imports done.
    assert main(_train(root / "warm-up", data)) == 0
    log = root / "events.log"
    run_dir = root / "reference"
    start = time.monotonic()
    status = _run(_train(run_dir, data), root / "reference.err",
                  Recorder(log, None).install)
    seconds = time.monotonic() - start
    assert status == 0, (root / "reference.err").read_text()
    events = []
    for line in log.read_text().splitlines():
        operation, target, count = line.split()
        events.append((operation, target, int(count)))
    return data, Reference(run_dir, seconds, events)


def _check_after_kills(run_dir: Path, data: Path, reference: Reference, label: str) -> str:
    """Resume; it must match the reference bit for bit or refuse in one line (and then the
    directory must start again cleanly). Returns what happened."""
    err = run_dir.parent / f"{run_dir.name}.resume.err"
    status = _run(_resume(run_dir), err)
    message = err.read_text()
    if status == 0:
        assert _losses(run_dir) == reference.losses, label
        assert _settings(run_dir) == reference.settings, label
        assert load_checkpoint(run_dir / "checkpoint.pt")["step"] == 6, label
        assert (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG", label
        assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")], label
        return "resumed"
    assert status == 2, f"{label}: status {status}: {message}"
    assert message.startswith("ipu-unit-scaling: error: ") and message.count("\n") == 1, \
        f"{label}: {message}"
    # Only a run that never reached a checkpoint may refuse to resume: then it starts again.
    assert not (run_dir / "checkpoint.pt").exists(), f"{label}: {message}"
    status = _run(_train(run_dir, data), err)
    assert status == 0, f"{label}: fresh start after refusal: {err.read_text()}"
    assert _losses(run_dir) == reference.losses, label
    return "restarted"


def _write_faults(reference: Reference) -> List[Tuple[str, str, int, str]]:
    """Every artefact write (the first and the last checkpoint) killed at each of its points."""
    checkpoints = max(count for operation, target, count in reference.events
                      if (operation, target) == ("replace", "checkpoint.pt"))
    telemetry_writes = max((count for operation, target, count in reference.events
                            if (operation, target) == ("write", "telemetry.csv")), default=0)
    faults = []
    for operation, target, count in reference.events:
        if target == "<directory>":
            continue  # a kill there is one right after the rename, which is in the list
        if target == "checkpoint.pt" and count not in (1, checkpoints):
            continue
        if target == "telemetry.csv":
            # Appended a row per write, as metrics.csv is, and over a hundred rows: a kill in
            # the first, a middle and the last row's write stands for all of them.
            if operation == "write" and count in (1, telemetry_writes // 2, telemetry_writes):
                faults.append((operation, target, count, "half"))
            elif operation == "fsync" and count == 2:
                faults.append((operation, target, count, "after"))
            continue
        if target == "metrics.csv+":
            if operation == "write" and count in (1, 3, 5):
                faults.append((operation, target, count, "half"))
            elif operation == "fsync" and count == 2:
                faults.append((operation, target, count, "after"))
        elif operation == "write":
            faults += [(operation, target, count, "before"), (operation, target, count, "half")]
        else:
            faults.append((operation, target, count, "after"))
    return faults


def test_kills_inside_every_artefact_write(scenario, tmp_path):
    data, reference = scenario
    faults = _write_faults(reference)
    targets = {fault[1] for fault in faults}
    assert {"config.yaml", "tokenizer.json", "metrics.csv", "metrics.csv+", "checkpoint.pt",
            "summary.json", "loss.png", "telemetry.csv"} <= targets
    assert len(faults) >= 30
    for index, fault in enumerate(faults):
        run_dir = tmp_path / f"kill{index}"
        status = _run(_train(run_dir, data), tmp_path / f"kill{index}.err",
                      Recorder(None, fault).install)
        assert status == -signal.SIGKILL, (fault, (tmp_path / f"kill{index}.err").read_text())
        outcome = _check_after_kills(run_dir, data, reference, str(fault))
        # Until config.yaml is in place there are no settings to resume with: the run must be
        # started again. From then on --resume works, from step 0 before the first checkpoint.
        before_settings = fault[1] == "config.yaml" and fault[0] != "replace"
        assert outcome == ("restarted" if before_settings else "resumed"), fault


@pytest.mark.parametrize("fault", [
    ("write", "metrics.csv", 1, "half"), ("replace", "metrics.csv", 1, "after"),
    ("write", "tokenizer.json", 1, "before"), ("write", "config.yaml", 1, "half"),
    ("replace", "config.yaml", 1, "after"), ("write", "metrics.csv+", 2, "half"),
])
def test_kills_inside_the_writes_of_a_resume(scenario, tmp_path, fault):
    data, reference = scenario
    run_dir = tmp_path / "run"
    first_checkpoint = Recorder(None, ("replace", "checkpoint.pt", 1, "after")).install
    assert _run(_train(run_dir, data), tmp_path / "train.err", first_checkpoint) == \
        -signal.SIGKILL
    assert _run(_resume(run_dir), tmp_path / "resume.err", Recorder(None, fault).install) == \
        -signal.SIGKILL
    assert _check_after_kills(run_dir, data, reference, str(fault)) == "resumed"


def test_kills_at_random_moments_even_while_resuming(scenario, tmp_path):
    data, reference = scenario
    chooser = random.Random(13)
    for trial in range(8):
        run_dir = tmp_path / f"run{trial}"
        err = tmp_path / f"run{trial}.err"
        _kill_after(_child(_train(run_dir, data), err), chooser.uniform(0, reference.seconds))
        if trial % 2 and run_dir.is_dir():  # and kill the resume too
            _kill_after(_child(_resume(run_dir), err), chooser.uniform(0, reference.seconds))
        if not run_dir.exists():
            continue  # killed before it made the directory: nothing to resume
        _check_after_kills(run_dir, data, reference, f"trial {trial}")


def _pause_at_third_row(go: Path) -> Callable[[], None]:
    """A child that stops before its third metrics row until ``go`` exists (lock held)."""
    def install() -> None:
        real_write = os.write
        rows = []

        def write(fd: int, data: Any) -> int:
            if _fd_target(fd) == "metrics.csv+":
                rows.append(fd)
                while len(rows) == 3 and not go.exists():
                    time.sleep(0.002)
            return real_write(fd, data)

        os.write = write  # type: ignore[assignment]
    return install


def test_a_second_writer_is_refused_while_the_first_runs(scenario, tmp_path):
    data, reference = scenario
    run_dir, go = tmp_path / "shared", tmp_path / "go"
    first = _child(_train(run_dir, data), tmp_path / "first.err", _pause_at_third_row(go))
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "metrics.csv").is_file() or len(_losses(run_dir)) < 2:
            assert time.monotonic() < deadline and not os.waitpid(first, os.WNOHANG)[0]
            time.sleep(0.002)
        intruders = {
            "train": _train(run_dir, data, "training.learning_rate=0.5"),
            "resume": ["train", "--resume", str(run_dir), "--set", "training.steps=8"],
            "compare": ["compare", "--config", "tiny", "--data", str(data), "--run-dir",
                        str(run_dir), "--regimes", "fp32", "--set", *SETTINGS],
        }
        for name, argv in intruders.items():
            err = tmp_path / f"{name}.err"
            assert _run(argv, err) == 2, name
            message = err.read_text()
            assert message.count("\n") == 1, message
            assert f"run directory {run_dir} is in use by process {first} on " in message
    finally:
        go.touch()
    assert _wait(first) == 0, (tmp_path / "first.err").read_text()
    assert _losses(run_dir) == reference.losses  # nothing of the intruders mixed in
    assert _settings(run_dir) == reference.settings


def test_writers_started_together_one_wins_whole(scenario, tmp_path):
    data, _ = scenario
    settings = {"a": ["training.learning_rate=0.01"], "b": ["training.learning_rate=0.02"]}
    solo = {}
    for name, extra in settings.items():
        solo[name] = tmp_path / f"solo-{name}"
        assert _run(_train(solo[name], data, *extra), tmp_path / f"solo-{name}.err") == 0
    for trial in range(3):
        run_dir = tmp_path / f"race{trial}"
        pids = {name: _child(_train(run_dir, data, *extra), tmp_path / f"{name}{trial}.err")
                for name, extra in settings.items()}
        statuses = {name: _wait(pid) for name, pid in pids.items()}
        assert sorted(statuses.values()) == [0, 2], statuses
        winner = next(name for name, status in statuses.items() if status == 0)
        loser = next(name for name in statuses if name != winner)
        message = (tmp_path / f"{loser}{trial}.err").read_text()
        assert message.count("\n") == 1 and ("in use by process" in message
                                             or "holds the checkpoint" in message), message
        assert _losses(run_dir) == _losses(solo[winner])
        assert _settings(run_dir) == _settings(solo[winner])

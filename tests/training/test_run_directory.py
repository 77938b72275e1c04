"""The run directory: atomic files, checksums, the lock, and what a resume accepts or refuses."""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import List

import pytest
import torch
from helpers import FAST, TEXT, files_in, one_line_error, run, train_args

import ipu_unit_scaling.training.run_directory as rundir
from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.loop import run_session
from ipu_unit_scaling.training.run_directory import (
    LOCK_FILE,
    RunError,
    RunLock,
    atomic_write,
    remove_temporaries,
)
from ipu_unit_scaling.training.run_records import (
    MetricsLog,
    load_checkpoint,
    metrics_up_to,
    read_metrics,
    save_checkpoint,
)


def losses(run_dir: Path) -> List[tuple]:
    return [(r["step"], r["train_loss"], r["val_loss"]) for r in read_metrics(run_dir)]


# ------------------------------------------------------------------------ atomic writes


def test_a_failed_write_keeps_the_old_file_whole_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    atomic_write(path, b"old contents\n")
    real_write = os.write

    def write_half_then_fail(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", write_half_then_fail)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, b"new contents, longer than the old ones\n")
    monkeypatch.undo()
    assert path.read_bytes() == b"old contents\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_files_get_the_usual_permissions(tmp_path):
    atomic_write(tmp_path / "summary.json", b"{}")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    names = [".checkpoint.pt.k2j4a9x1.tmp", ".config.yaml.abcdefgh.tmp", "checkpoint.pt.x1.tmp",
             ".loss.png.q1w2e3r4.tmp", "notes.tmp", ".other.abcdefgh.tmp", "config.yaml"]
    for name in names:
        (tmp_path / name).write_text("x")
    removed = remove_temporaries(tmp_path)
    assert sorted(removed) == sorted(names[:4])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[4:])


# ------------------------------------------------------------------------ checkpoints


def test_checkpoint_round_trip_and_every_damage_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    state = {"step": 3, "model": {"w": torch.arange(100.0)}, "val_curve": [[1, 2.5]]}
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], state["model"]["w"])
    good = path.read_bytes()
    header_end = good.index(b"\n") + 1
    # one flipped byte anywhere in the payload: a sample of positions, first and last included
    positions = sorted({header_end, len(good) - 1, *range(header_end, len(good), 97)})
    for position in positions:
        damaged = bytearray(good)
        damaged[position] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(RunError, match="checksum does not match"):
            load_checkpoint(path)
    path.write_bytes(good[:-10])
    with pytest.raises(RunError, match="truncated"):
        load_checkpoint(path)
    path.write_bytes(good[:header_end - 5])
    with pytest.raises(RunError):
        load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(RunError, match="not a checkpoint of this package"):
        load_checkpoint(path)
    buffer = tmp_path / "plain.pt"
    torch.save(state, buffer)  # a torch file without our header is refused, not trusted
    with pytest.raises(RunError, match="not a checkpoint of this package"):
        load_checkpoint(buffer)


def test_a_resume_from_a_flipped_checkpoint_refuses_in_one_line(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    assert run(capsys, *train_args(run_dir, data, "training.steps=2"))[0] == 0
    checkpoint = run_dir / "checkpoint.pt"
    damaged = bytearray(checkpoint.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    checkpoint.write_bytes(bytes(damaged))
    before = files_in(run_dir)
    status, _, err = run(capsys, "train", "--resume", run_dir, "--quiet", "--set",
                         "training.steps=4")
    assert status == 2 and one_line_error(err) and "checkpoint.pt is damaged" in err
    assert files_in(run_dir) == before  # nothing trained


# ------------------------------------------------------------------------ the lock


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunError) as info:
            with RunLock(tmp_path):
                pass
        assert f"is in use by process {os.getpid()} on " in str(info.value)
    with RunLock(tmp_path):  # released at the end of the first
        pass


def test_a_writer_refused_just_as_the_lock_was_taken_still_names_the_holder(tmp_path):
    import fcntl
    import threading

    fd = os.open(tmp_path / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # taken, the holder's name not written yet
    late = threading.Timer(0.1, lambda: os.pwrite(fd, b"process 99 on elsewhere (train)", 0))
    late.start()
    try:
        with pytest.raises(RunError, match=r"in use by process 99 on elsewhere \(train\)"):
            RunLock(tmp_path).acquire()
    finally:
        late.join()
        os.close(fd)


def test_train_refuses_a_directory_another_run_holds(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with RunLock(run_dir):
        status, _, err = run(capsys, *train_args(run_dir, data, "training.steps=2"))
        assert status == 2 and one_line_error(err)
        assert f"in use by process {os.getpid()}" in err
        status, _, err = run(capsys, "compare", "--config", "tiny", "--run-dir", run_dir,
                             "--regimes", "fp32")
        assert status == 2 and one_line_error(err) and "in use by process" in err
    assert list(run_dir.iterdir()) == []  # nothing written meanwhile; the lock file removed


# ------------------------------------------------------------------------ metrics


def _metrics_file(tmp_path: Path, rows: int, tail: str = "") -> Path:
    log = MetricsLog(tmp_path / "metrics.csv", fresh=True)
    for step in range(1, rows + 1):
        log.write({"step": step, "lr": "0.1", "train_loss": repr(1.0 / step), "val_loss": "",
                   "tokens_per_s": "10.0", "elapsed_s": "0.1"})
    log.close()
    with open(tmp_path / "metrics.csv", "a") as handle:
        handle.write(tail)
    return tmp_path / "metrics.csv"


def test_metrics_keep_the_checkpointed_steps_and_drop_a_row_cut_short(tmp_path):
    path = _metrics_file(tmp_path, 5, tail="6,0.1,0.16")  # a kill in the middle of row 6
    kept = metrics_up_to(tmp_path, 4).decode().splitlines()
    assert kept[0] == "step,lr,train_loss,val_loss,tokens_per_s,elapsed_s"
    assert [line.split(",")[0] for line in kept[1:]] == ["1", "2", "3", "4"]
    assert metrics_up_to(tmp_path, 5).decode() == path.read_text()[: -len("6,0.1,0.16")]
    with pytest.raises(RunError, match="metrics.csv is damaged"):
        metrics_up_to(tmp_path, 6)  # the checkpoint's own step must be whole


@pytest.mark.parametrize("damage", ["missing", "empty", "header", "gap", "cut", "garbage"])
def test_damaged_metrics_refuse_the_resume(tmp_path, damage):
    path = _metrics_file(tmp_path, 4)
    lines = path.read_text().splitlines(keepends=True)
    if damage == "missing":
        path.unlink()
    elif damage == "empty":
        path.write_text("")
    elif damage == "header":
        path.write_text("".join(["step,loss\n"] + lines[1:]))
    elif damage == "gap":
        path.write_text("".join(lines[:2] + lines[3:]))
    elif damage == "cut":
        path.write_text("".join(lines[:3]) + lines[3][:5])
    else:
        path.write_bytes(b"\xff\xfe" + path.read_bytes())
    with pytest.raises(RunError, match="metrics.csv is (missing|damaged)"):
        metrics_up_to(tmp_path, 3)


# ------------------------------------------------------------------------ resume rules


def _first_lines(text: str, limit: int) -> str:
    """The whole lines within the first ``limit`` characters of ``text``."""
    return text[:text.rindex("\n", 0, limit) + 1]


DAMAGE = {
    # artefact: (how to damage it, words the refusal must contain)
    "config-missing": (lambda d: (d / "config.yaml").unlink(), "config.yaml is missing"),
    "config-empty": (lambda d: (d / "config.yaml").write_text(""), "config.yaml is empty"),
    # Cut at a line end: valid YAML that lacks keys (a cut mid-line is a YAML syntax error).
    "config-truncated": (lambda d: (d / "config.yaml").write_text(_first_lines(
        (d / "config.yaml").read_text(), 300)), "config.yaml is incomplete"),
    "config-cut-value": (lambda d: (d / "config.yaml").write_text(
        (d / "config.yaml").read_text()[:-3]), "config.yaml names backend 'au'"),
    "config-binary": (lambda d: (d / "config.yaml").write_bytes(b"\x00\xff" * 50),
                      "config.yaml"),
    "config-list": (lambda d: (d / "config.yaml").write_text("[1, 2]\n"),
                    "config.yaml is damaged"),
    "config-bad-value": (lambda d: (d / "config.yaml").write_text(
        (d / "config.yaml").read_text().replace("depth: 2", "depth: two")),
        "config.yaml is damaged"),
    "tokenizer-missing": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    "tokenizer-empty": (lambda d: (d / "tokenizer.json").write_text(""),
                        "tokenizer.json is damaged"),
    "tokenizer-truncated": (lambda d: (d / "tokenizer.json").write_text(
        (d / "tokenizer.json").read_text()[:20]), "tokenizer.json is damaged"),
    "tokenizer-other": (lambda d: (d / "tokenizer.json").write_text(
        json.dumps({"kind": "char", "chars": ["a", "b"]})), "tokenizer.json does not match"),
    "tokenizer-wrong-type": (lambda d: (d / "tokenizer.json").write_text(
        json.dumps({"kind": "char", "chars": [1, [2]]})), "tokenizer.json is damaged"),
    "metrics-missing": (lambda d: (d / "metrics.csv").unlink(), "metrics.csv is missing"),
    "metrics-cut": (lambda d: (d / "metrics.csv").write_text(
        (d / "metrics.csv").read_text()[:-30]), "metrics.csv is damaged"),
    "checkpoint-empty": (lambda d: (d / "checkpoint.pt").write_bytes(b""), "checkpoint.pt"),
    "checkpoint-truncated": (lambda d: (d / "checkpoint.pt").write_bytes(
        (d / "checkpoint.pt").read_bytes()[:1000]), "checkpoint.pt is truncated"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_resume_refuses_a_damaged_artefact_in_one_line_naming_it(capsys, finished, damage):
    spoil, words = DAMAGE[damage]
    spoil(finished)
    before = files_in(finished)
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                         "training.steps=6")
    assert status == 2 and one_line_error(err), err
    assert words in err
    assert files_in(finished) == before


def test_resuming_with_fewer_steps_than_the_checkpoint_refuses(capsys, finished):
    status, _, err = run(capsys, "train", "--resume", finished, "--set", "training.steps=2")
    assert status == 2 and one_line_error(err)
    assert "checkpoint is at step 4, beyond training.steps = 2" in err


def test_resuming_a_finished_run_with_its_own_steps_only_rewrites_its_summary(capsys, finished):
    before = losses(finished)
    (finished / "summary.json").unlink()
    status, out, _ = run(capsys, "train", "--resume", finished)
    assert status == 0 and "resuming" in out
    assert losses(finished) == before
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    assert summary["final_train_loss"] == float(before[-1][1])


def test_a_run_killed_before_its_first_checkpoint_can_be_started_again(capsys, tmp_path, data):
    reference = tmp_path / "reference"
    assert run(capsys, *train_args(reference, data, "training.steps=3"))[0] == 0
    # What a kill before the first checkpoint leaves: settings, some rows, a stale temporary.
    killed = tmp_path / "killed"
    killed.mkdir()
    for name in ("config.yaml", "tokenizer.json"):
        (killed / name).write_bytes((reference / name).read_bytes())
    (killed / "metrics.csv").write_text((reference / "metrics.csv").read_text()[:150])
    (killed / ".checkpoint.pt.zz9x8c7v.tmp").write_bytes(b"half a checkpoint")
    restarted = tmp_path / "restarted"
    restarted.mkdir()
    for path in killed.iterdir():
        (restarted / path.name).write_bytes(path.read_bytes())

    # --resume starts it from step 0 with its saved config...
    status, _, err = run(capsys, "train", "--resume", killed, "--quiet")
    assert status == 0, err
    assert losses(killed) == losses(reference)
    # ...and so does starting it again with the same --run-dir.
    status, _, err = run(capsys, *train_args(restarted, data, "training.steps=3"))
    assert status == 0, err
    assert losses(restarted) == losses(reference)
    for run_dir in (killed, restarted):
        assert not [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_a_resume_without_settings_to_restart_from_says_how_to_start_again(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    status, _, err = run(capsys, "train", "--resume", tmp_path / "run")
    assert status == 2 and one_line_error(err) and "config.yaml is missing" in err


def test_a_directory_with_other_files_or_a_checkpoint_is_not_overwritten(capsys, finished, data):
    status, _, err = run(capsys, *train_args(finished, data, "training.steps=2"))
    assert status == 2 and one_line_error(err) and "holds the checkpoint" in err
    (finished / "checkpoint.pt").unlink()
    (finished / "notes.txt").write_text("mine")
    status, _, err = run(capsys, *train_args(finished, data, "training.steps=2"))
    assert status == 2 and one_line_error(err) and "not empty (notes.txt)" in err
    assert (finished / "notes.txt").read_text() == "mine"


def test_stale_temporaries_are_cleaned_when_a_run_resumes(capsys, finished):
    (finished / ".checkpoint.pt.a1b2c3d4.tmp").write_bytes(b"partial")
    (finished / ".summary.json.e5f6g7h8.tmp").write_bytes(b"{")
    assert run(capsys, "train", "--resume", finished, "--quiet", "--set",
               "training.steps=6")[0] == 0
    assert not [p for p in finished.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_run_directory_is_one_line(capsys, tmp_path, data):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o555)
    try:
        status, _, err = run(capsys, *train_args(run_dir, data, "training.steps=2"))
    finally:
        run_dir.chmod(0o755)
    assert status == 2 and one_line_error(err) and "Permission denied" in err


def test_an_unwritable_run_directory_is_one_line_even_for_root(capsys, tmp_path, data,
                                                              monkeypatch):
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "run")) and flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(rundir.os, "open", refusing_open)
    status, _, err = run(capsys, *train_args(tmp_path / "run", data, "training.steps=2"))
    assert status == 2 and one_line_error(err)
    assert re.search(r"cannot write to run directory .*run: Permission denied", err)


# ------------------------------------------------------------------------ smaller rules


def test_warmup_longer_than_the_run_is_clamped_and_said(capsys, tmp_path, data):
    status, out, _ = run(capsys, "train", "--config", "tiny", "--data", data, "--run-dir",
                         tmp_path / "run", "--set", *FAST, "training.steps=3",
                         "training.warmup_steps=50")
    assert status == 0
    assert "training.warmup_steps (50) is longer than the run; warming up over all 3 steps" in out
    rates = [float(r["lr"]) for r in read_metrics(tmp_path / "run")]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(0.06)


def test_device_iterations_never_run_past_the_steps_nor_skip_the_last_evaluation(
        capsys, tmp_path, data):
    status, _, err = run(capsys, *train_args(tmp_path / "bad", data, "training.steps=3",
                                             "ipu.device_iterations=2"))
    assert status == 2 and one_line_error(err)
    assert "training.steps: got 3; must be a multiple of ipu.device_iterations (2)" in err
    assert run(capsys, *train_args(tmp_path / "run", data, "training.steps=6",
                                   "ipu.device_iterations=2", "training.eval_interval=3"))[0] == 0
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5", "6"]
    # evaluations at the end of the calls that reach step 3 and the last step
    assert [r["step"] for r in rows if r["val_loss"]] == ["4", "6"]


def test_empty_data_argument_is_refused_not_ignored(capsys, tmp_path):
    status, _, err = run(capsys, "train", "--config", "tiny", "--data", "", "--run-dir",
                         tmp_path / "run")
    assert status == 2 and one_line_error(err) and "--data needs a file name" in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ compare


def compare_args(run_dir: Path, data: Path, *settings: str, quiet: bool = True) -> List[str]:
    return ["compare", "--config", "tiny", "--data", str(data), "--run-dir", str(run_dir),
            *(["--quiet"] if quiet else []), "--regimes", "fp32", "unit-fp8", "--set", *FAST,
            *settings]


def test_compare_reuses_a_regime_only_with_the_same_settings(capsys, tmp_path, data):
    run_dir = tmp_path / "compare"
    assert run(capsys, *compare_args(run_dir, data, "training.steps=3"))[0] == 0
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    status, _, err = run(capsys, *compare_args(run_dir, data, "training.steps=6"))
    assert status == 2 and one_line_error(err)
    assert "fp32 was trained with other settings (training.steps: 3 -> 6" in err
    status, _, err = run(capsys, *compare_args(run_dir, data, "training.steps=3",
                                               "compare.learning_rates.fp32=0.1"))
    assert status == 2 and "training.learning_rate: 0.006 -> 0.1" in err
    other = tmp_path / "other.txt"
    other.write_text(TEXT.replace("fox", "cat"))
    status, _, err = run(capsys, *compare_args(run_dir, other, "training.steps=3"))
    assert status == 2 and "is not the text it trained on" in err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files

    # Settings that are not the regime's (another regime's learning rate) do not matter.
    status, out, _ = run(capsys, *compare_args(run_dir, data, "training.steps=3",
                                               "compare.learning_rates.fp16=0.1", quiet=False))
    assert status == 0 and out.count("reusing the finished run") == 2
    table = (run_dir / "compare.md").read_text()
    assert "| fp32 |" in table and "| unit-fp8 |" in table


class Killed(BaseException):
    """Stands for a kill: nothing in the package catches it."""


def test_compare_resumes_a_regime_killed_after_a_checkpoint(capsys, tmp_path, data, monkeypatch):
    settings = ["training.steps=4", "training.checkpoint_interval=2"]
    reference = tmp_path / "reference"
    assert run(capsys, *compare_args(reference, data, *settings))[0] == 0

    real_save = save_checkpoint

    def save_then_die(path, state):
        real_save(path, state)
        if state["step"] == 2 and path.parent.name == "unit-fp8":
            raise Killed

    monkeypatch.setattr(run_session, "save_checkpoint", save_then_die)
    run_dir = tmp_path / "compare"
    with pytest.raises(Killed):
        main(compare_args(run_dir, data, *settings))
    monkeypatch.undo()
    assert not (run_dir / "unit-fp8" / "summary.json").exists()

    status, out, _ = run(capsys, *compare_args(run_dir, data, *settings, quiet=False))
    assert status == 0 and "fp32: reusing" in out and "unit-fp8: resuming" in out
    for regime in ("fp32", "unit-fp8"):
        assert losses(run_dir / regime) == losses(reference / regime)


def test_compare_curves_have_at_least_ten_points(capsys, tmp_path, data):
    run_dir = tmp_path / "compare"
    assert run(capsys, *compare_args(run_dir, data, "training.steps=20",
                                     "training.eval_interval=100"))[0] == 0
    for regime in ("fp32", "unit-fp8"):
        curve = json.loads((run_dir / regime / "summary.json").read_text())["val_curve"]
        assert [step for step, _ in curve] == list(range(2, 21, 2))
    assert (run_dir / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_a_missing_plotting_library_costs_the_figure_only(capsys, tmp_path, data, monkeypatch):
    import ipu_unit_scaling.training.plots as plots

    def no_matplotlib():
        raise RuntimeError("plots need matplotlib: pip install matplotlib")

    monkeypatch.setattr(plots, "load_pyplot", no_matplotlib)
    status, out, err = run(capsys, "train", "--config", "tiny", "--data", data, "--run-dir",
                           tmp_path / "run", "--set", *FAST, "training.steps=2")
    assert status == 0, err
    assert "loss.png not written: plots need matplotlib" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"


# A run directory at rest holds no ``.lock``: the lock file lives while someone holds it.
needs_fcntl = pytest.mark.skipif(importlib.util.find_spec("fcntl") is None,
                                 reason="the lock file's checks use fcntl (POSIX)")


@needs_fcntl
def test_a_writer_removes_its_lock_file_when_it_ends(tmp_path):
    with RunLock(tmp_path):
        assert (tmp_path / LOCK_FILE).exists()
    assert not (tmp_path / LOCK_FILE).exists()


@needs_fcntl
def test_the_last_reader_out_removes_the_lock_file(tmp_path):
    first, second = RunLock(tmp_path, shared=True), RunLock(tmp_path, shared=True)
    first.acquire()
    second.acquire()
    first.release()
    assert (tmp_path / LOCK_FILE).exists()  # the second still reads
    with pytest.raises(RunError, match="in use by"):
        RunLock(tmp_path).acquire()  # and a writer is still refused
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


@needs_fcntl
def test_a_lock_file_removed_between_open_and_lock_is_not_the_one_taken(tmp_path,
                                                                        monkeypatch):
    # The holder ends just after a newcomer opened the lock file and before it locks it: the
    # newcomer must lock the file at the path, not the removed one, or a third process could
    # lock a new file and both would write the directory.
    holder = RunLock(tmp_path)
    holder.acquire()
    opened = RunLock._open_writing
    calls = []

    def open_then_holder_ends(self):
        fd = opened(self)
        if not calls:
            holder.release()
        calls.append(fd)
        return fd

    monkeypatch.setattr(RunLock, "_open_writing", open_then_holder_ends)
    newcomer = RunLock(tmp_path)
    newcomer.acquire()
    monkeypatch.undo()
    try:
        assert len(calls) == 2  # it opened again
        assert newcomer._still_the_lock_file(newcomer._fd)
        with pytest.raises(RunError, match="in use by"):
            RunLock(tmp_path).acquire()
    finally:
        newcomer.release()
    assert not (tmp_path / LOCK_FILE).exists()

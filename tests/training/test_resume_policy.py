"""What a resume may change, what every reader checks a run against, and which directories
compare, sweep and evaluate --out accept: each refusal is one line, and leaves the directory as
it was.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import List

import helpers
import pytest
from helpers import ROOT, TEXT, one_line_error, run
from helpers import run_files as files_in

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.training.resume_policy import (
    KEPT,
    MAY_CHANGE,
    RESUME_RULES,
    flat_settings,
    policy_table,
    resume_refusal,
)
from ipu_unit_scaling.training.run_config import Config
from ipu_unit_scaling.training.run_directory import RunLock
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

# helpers.FAST, then an evaluation and a checkpoint every 2 steps.
EVERY_2 = ["training.eval_interval=2", "training.checkpoint_interval=2"]
FAST = [*helpers.FAST, *EVERY_2]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The text file, made once for the module (conftest.py's is made for each test), since
    :func:`trained` is."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT)
    return path


def train_args(run_dir: Path, data: Path, *settings: str) -> List[str]:
    """helpers.train_args with :data:`FAST`'s settings."""
    return helpers.train_args(run_dir, data, *EVERY_2, *settings)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """A finished 4-step run (checkpoints at 2 and 4), kept pristine: tests copy it."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_args(run_dir, data, "training.steps=4")) == 0
    return run_dir


@pytest.fixture
def finished(trained, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir


# ------------------------------------------------------------------------ the policy itself


def test_every_config_key_is_classified_and_nothing_else():
    keys = set(flat_settings(Config().to_dict()))
    assert set(RESUME_RULES) == keys, (
        f"unclassified: {sorted(keys - set(RESUME_RULES))}; "
        f"gone: {sorted(set(RESUME_RULES) - keys)}: add them to resume_policy.RESUME_RULES")
    assert {rule for rule, _ in RESUME_RULES.values()} == {KEPT, MAY_CHANGE}
    assert all(why for _, why in RESUME_RULES.values())


def test_the_guide_shows_the_policy_table():
    guide = (ROOT / "docs" / "guide" / "run-directories.md").read_text()
    start = guide.index("<!-- resume-policy: generated")
    start = guide.index("\n", start) + 1
    end = guide.index("<!-- resume-policy: end -->")
    assert guide[start:end].strip() == policy_table(), \
        "regenerate the table from resume_policy.policy_table()"


@pytest.mark.parametrize("key", [k for k, (rule, _) in RESUME_RULES.items() if rule == KEPT])
def test_every_kept_key_is_refused_and_named(key):
    saved = Config().to_dict()
    requested = json.loads(json.dumps(saved))
    section = requested
    *path, leaf = key.split(".")
    for name in path:
        section = section[name]
    section[leaf] = ["another value"]
    refusal = resume_refusal(saved, requested, trains=True)
    assert refusal is not None and f"a resume keeps {key} " in refusal


def test_keys_that_may_change_pass_only_while_steps_are_left():
    saved = Config().to_dict()
    requested = json.loads(json.dumps(saved))
    requested["training"]["learning_rate"] = 0.5
    requested["training"]["steps"] = 600
    assert resume_refusal(saved, requested, trains=True) is None
    refusal = resume_refusal(saved, requested, trains=False)
    assert refusal is not None and "trains nothing and keeps its record" in refusal


# ------------------------------------------------------------------------ resumes refused


@pytest.mark.parametrize("setting", [
    "data.val_fraction=0.5", "training.seed=3", "training.eval_batches=2",
    "precision.dtype=fp16", "precision.fp8.scaling=static", "training.batch_size=4",
    "training.weight_decay=0.1", "training.optimizer=sgd"])
def test_a_resume_that_changes_a_kept_key_is_refused_before_anything_changes(
        capsys, finished, setting):
    before = files_in(finished)
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                         "training.steps=6", setting)
    key = setting.split("=")[0]
    assert status == 2 and one_line_error(err) and f"a resume keeps {key}" in err, err
    assert files_in(finished) == before
    # and a plain resume still goes on, with its own settings
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                         "training.steps=6")
    assert status == 0, err
    assert [int(r["step"]) for r in read_metrics(finished)] == list(range(1, 7))


def test_a_finished_run_that_trains_nothing_keeps_its_record(capsys, finished):
    before = files_in(finished)
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                         "precision.dtype=fp16", "training.learning_rate=0.5")
    assert status == 2 and one_line_error(err), err
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                         "training.learning_rate=0.5")
    assert status == 2 and one_line_error(err) and "raise training.steps" in err, err
    assert files_in(finished) == before
    # A resume with its own settings trains nothing and rewrites nothing.
    status, _, err = run(capsys, "train", "--resume", finished, "--quiet")
    assert status == 0, err
    assert files_in(finished) == before


# ------------------------------------------------------------------------ a hand-edited config


@pytest.mark.parametrize("old, new", [
    ("attn_tau: 0.2", "attn_tau: 5.0"), ("unit_scaled: true", "unit_scaled: false"),
    ("parametrization: unit", "parametrization: u-mup")])
def test_a_hand_edited_config_that_keeps_the_shapes_is_refused_by_every_reader(
        capsys, finished, tmp_path, old, new):
    config = finished / "config.yaml"
    text = config.read_text()
    assert old in text
    config.write_text(text.replace(old, new))
    before = files_in(finished)
    key = "model." + old.split(":")[0]
    for argv in (["train", "--resume", finished, "--quiet", "--set", "training.steps=6"],
                 ["evaluate", finished, "--quiet", "--precision", "fp32"],
                 ["sample", finished, "--tokens", "3"],
                 ["train", "--init-from", finished, "--run-dir", tmp_path / "tuned", "--quiet"]):
        status, out, err = run(capsys, *argv)
        assert status == 2 and one_line_error(err), (argv, err)
        assert f"trained with {key} = " in err and "config.yaml was edited" in err, err
    assert files_in(finished) == before
    assert not (tmp_path / "tuned").exists()


def test_checkpoints_record_their_model_and_precision(trained):
    settings = load_checkpoint(trained / "checkpoint.pt")["settings"]
    assert settings["model"]["attn_tau"] == 0.2 and settings["precision"]["dtype"] == "fp8"


# ------------------------------------------------------------------------ FIFOs and devices


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(),
                    reason="needs FIFOs and /dev/zero")
@pytest.mark.parametrize("name, make, words", [
    ("checkpoint.pt", _fifo, "checkpoint.pt is a FIFO, not a regular file"),
    ("metrics.csv", _fifo, "metrics.csv: it is a FIFO, not a regular file"),
    ("checkpoint.pt", _dev_zero, "checkpoint.pt is a character device, not a regular file"),
    ("metrics.csv", _dev_zero, "not a regular file"),
    ("summary.json", _fifo, None),
])
def test_fifos_and_devices_are_refused_without_waiting_or_reading(capsys, finished, name, make,
                                                                   words):
    make(finished / name)

    def stuck(signum, frame):
        raise AssertionError(f"train --resume waited on {name}")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(60)
    try:
        status, _, err = run(capsys, "train", "--resume", finished, "--quiet", "--set",
                             "training.steps=6")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    if words is None:  # (the summary is only consulted: the checkpoint resumes)
        assert status == 0, err
        return
    assert status == 2 and one_line_error(err) and words in err, err
    assert (finished / name).is_symlink() or not (finished / name).is_file()


# ------------------------------------------------------------------------ compare and sweep


def compare_args(run_dir: Path, data: Path, *regimes: str) -> List[str]:
    return ["compare", "--config", "tiny", "--data", str(data), "--run-dir", str(run_dir),
            "--quiet", "--regimes", *regimes, "--set", *FAST, "training.steps=2"]


def test_compare_takes_only_its_own_directories(capsys, data, trained, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("mine")
    for run_dir, words in ((trained, "holds checkpoint.pt (a run of train)"),
                           (notes, "holds ideas.txt (not one of its results)")):
        before = files_in(run_dir)
        status, _, err = run(capsys, *compare_args(run_dir, data, "fp32"))
        assert status == 2 and one_line_error(err) and "is not a compare directory" in err
        assert words in err, err
        assert files_in(run_dir) == before


def test_compare_keeps_the_regimes_it_holds_and_never_reuses_one_without_its_checkpoint(
        capsys, data, tmp_path):
    run_dir = tmp_path / "compare"
    assert run(capsys, *compare_args(run_dir, data, "fp32"))[0] == 0
    assert run(capsys, *compare_args(run_dir, data, "fp16"))[0] == 0
    table = (run_dir / "compare.md").read_text()
    fp16 = next(line for line in table.splitlines() if line.startswith("| fp16 |"))
    assert "| fp32 |" in table and "%" in fp16  # the gap to fp32, fp32 being there

    (run_dir / "fp32" / "checkpoint.pt").unlink()
    before = files_in(run_dir)
    status, _, err = run(capsys, *compare_args(run_dir, data, "fp32"))
    assert status == 2 and one_line_error(err), err
    assert "cannot reuse" in err and "checkpoint.pt is missing" in err
    assert files_in(run_dir) == before


def test_a_sweep_of_another_axis_is_refused_instead_of_overwriting(capsys, data, tmp_path):
    from ipu_unit_scaling.apps.sweep import check_sweep_dir
    from ipu_unit_scaling.training.run_directory import RunError

    run_dir = tmp_path / "sweep"
    (run_dir / "unit").mkdir(parents=True)
    (run_dir / "sweep.json").write_text(json.dumps({"points": []}))  # a learning-rate sweep
    check_sweep_dir(run_dir, None)
    with pytest.raises(RunError, match="holds a sweep of the learning rate; a sweep of --key "
                                       "model.residual_mult would overwrite"):
        check_sweep_dir(run_dir, "model.residual_mult")
    (run_dir / "config.yaml").write_text("")
    with pytest.raises(RunError, match="is not a sweep directory: it holds config.yaml"):
        check_sweep_dir(run_dir, None)


def test_the_sweep_command_refuses_a_train_run(capsys, data, trained):
    before = files_in(trained)
    status, _, err = run(capsys, "sweep", "--config", "tiny", "--data", data, "--run-dir",
                         trained, "--quiet", "--models", "unit", "--widths", "32", "--depths",
                         "2", "--set", *FAST, "training.steps=2")
    assert status == 2 and one_line_error(err) and "is not a sweep directory" in err, err
    assert files_in(trained) == before


def test_evaluate_out_refuses_a_directory_a_run_is_writing(capsys, trained, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    with RunLock(busy):  # as a training run holds it
        status, _, err = run(capsys, "evaluate", trained, "--quiet", "--precision", "fp32",
                             "--out", busy)
    assert status == 2 and one_line_error(err) and "is in use by" in err, err
    assert not (busy / "evaluate.md").exists()


def test_compare_refuses_to_reuse_a_regime_whose_checkpoint_is_another_models(
        capsys, data, tmp_path):
    run_dir = tmp_path / "compare"
    assert run(capsys, *compare_args(run_dir, data, "fp32", "unit-fp32"))[0] == 0
    # Same shapes, another model: the unit-scaled regime's checkpoint in the plain one's place.
    shutil.copy(run_dir / "unit-fp32" / "checkpoint.pt", run_dir / "fp32" / "checkpoint.pt")
    before = files_in(run_dir)
    status, _, err = run(capsys, *compare_args(run_dir, data, "fp32"))
    assert status == 2 and one_line_error(err), err
    assert "cannot reuse" in err and "trained with model.unit_scaled = True" in err
    assert files_in(run_dir) == before

"""Scenarios of a user who distrusts every result: settings that must not change silently,
results that must not be reused or read from the wrong run, and runs that must not be lost.

Each test runs the command as a user does (``cli.main`` or ``python -m ipu_unit_scaling``)
on a run of a second or less.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from helpers import ONE_IPU, ROOT, TEXT

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.apps.mlm import MLMConfig

# One stage, a few steps, one validation batch.
SMALL = [*ONE_IPU,
         "training.steps=3", "training.eval_batches=1", "training.warmup_steps=0",
         "training.eval_interval=3"]


def _text(tmp: Path, content: str = TEXT, name: str = "text.txt") -> str:
    path = tmp / name
    path.write_text(content, encoding="utf-8")
    return str(path)


def _train(tmp: Path, run_dir: Path, *overrides: str) -> List[str]:
    return ["train", "--config", "tiny", "--data", _text(tmp), "--run-dir", str(run_dir),
            "--quiet", "--set", *SMALL, *overrides]


def _files(directory: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ a reader that goes away


def _command(tmp: Path, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "ipu_unit_scaling", *argv], cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_run_whose_log_reader_goes_away_trains_to_its_end(tmp_path):
    # ipu-unit-scaling train ... | head -1: the log is gone, the run is not
    run_dir = tmp_path / "run"
    process = _command(tmp_path, "train", "--config", "tiny", "--data", _text(tmp_path),
                       "--run-dir", str(run_dir), "--set", *SMALL, "training.steps=30",
                       "training.log_interval=1")
    assert process.stdout is not None and process.stderr is not None
    process.stdout.readline()
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 0, err
    assert "ipu-unit-scaling:" not in err and "Error" not in err, err  # (torch may warn)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["checkpoint_step"] == 30


def test_sample_stops_quietly_when_its_reader_goes_away(tmp_path):
    # ipu-unit-scaling sample ... | head -c 20
    assert main(_train(tmp_path, tmp_path / "run")) == 0
    process = _command(tmp_path, "sample", str(tmp_path / "run"), "--tokens", "1000000")
    assert process.stdout is not None and process.stderr is not None
    process.stdout.read(20)
    process.stdout.close()
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 141, err  # 128 + SIGPIPE, as a shell reports it
    assert "ipu-unit-scaling:" not in err and "Error" not in err, err  # (torch may warn)


# ------------------------------------------------------------------ a resumed run's model


def test_a_resume_keeps_the_model_it_trained(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(_train(tmp_path, run_dir)) == 0
    before = _files(run_dir)
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--quiet", "--set", "training.steps=4",
                 "model.unit_scaled=false"]) == 2
    error = _error(capsys)
    assert "model.unit_scaled" in error and str(run_dir) in error
    assert _files(run_dir) == before
    # dropout shapes no weight: it may change
    assert main(["train", "--resume", str(run_dir), "--quiet", "--set", "training.steps=4",
                 "model.dropout=0.1"]) == 0


# ------------------------------------------------------------------ whose checkpoint is read


@pytest.mark.parametrize("reader", ["evaluate", "sample", "resume", "init-from"])
def test_a_checkpoint_of_another_run_is_refused(reader, tmp_path, capsys):
    # Two runs of the same model on the same text, from other seeds: the checkpoints fit
    # either directory; only the run's own log tells them apart.
    assert main(_train(tmp_path, tmp_path / "run")) == 0
    assert main(_train(tmp_path, tmp_path / "other", "training.seed=1")) == 0
    shutil.copy(tmp_path / "other" / "checkpoint.pt", tmp_path / "run" / "checkpoint.pt")
    before = _files(tmp_path / "run")
    capsys.readouterr()
    argv = {"evaluate": ["evaluate", str(tmp_path / "run"), "--precision", "fp32"],
            "sample": ["sample", str(tmp_path / "run"), "--tokens", "3"],
            "resume": ["train", "--resume", str(tmp_path / "run"), "--quiet", "--set",
                       "training.steps=4"],
            "init-from": ["train", "--init-from", str(tmp_path / "run"), "--run-dir",
                          str(tmp_path / "tuned"), "--quiet"]}[reader]
    assert main(argv) == 2
    error = _error(capsys)
    assert "checkpoint.pt" in error and "metrics.csv" in error
    assert not (tmp_path / "tuned").exists()
    assert _files(tmp_path / "run") == before


def test_a_run_copied_without_its_log_is_still_read(tmp_path, capsys):
    assert main(_train(tmp_path, tmp_path / "run")) == 0
    (tmp_path / "run" / "metrics.csv").unlink()
    assert main(["evaluate", str(tmp_path / "run"), "--precision", "fp32"]) == 0


# ------------------------------------------------------------------ mlm settings


@pytest.mark.parametrize("override, words", [
    ("mlm.steps=true", "steps"),
    ("mlm.warmup_steps=true", "warmup_steps"),
    ("mlm.batch_size=true", "batch_size"),
    ("mlm.warmup_steps=-5", "warmup_steps"),
    ("mlm.eval_interval=-1", "eval_interval"),
    ("mlm.val_fraction=2", "val_fraction"),
    ("mlm.val_fraction=0", "val_fraction"),
    ("mlm.attn_tau=-1", "attn_tau"),
    ("mlm.mlp_tau=.nan", "mlp_tau"),
    ("mlm.mlp_expansion=0", "mlp_expansion"),
    ("mlm.data=123", "data"),
    ("mlm.learning_rates.fp32=true", "learning_rates.fp32"),
    ("mlm.learning_rates.fp32=.nan", "learning_rates.fp32"),
    ("mlm.learning_rates.fp32=-1", "learning_rates.fp32"),
    ("mlm.learning_rates.fp32=1e400", "learning_rates.fp32"),
    ("mlm.learning_rates.fp32=abc", "learning_rates.fp32"),
    ("mlm.learning_rates.fp32=~", "learning_rates.fp32"),
])
def test_an_mlm_setting_is_never_changed_silently(override, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        MLMConfig().with_overrides([override])


@pytest.mark.parametrize("override, field, value", [
    ("mlm.learning_rates.fp32=1e-3", "learning_rates", 1e-3),
    ("mlm.mask_prob=0.2", "mask_prob", 0.2),
    ("mlm.steps=1_000", "steps", 1000),
    ("mlm.attn_tau=1", "attn_tau", 1.0),
    ("mlm.eval_interval=0", "eval_interval", 0),
])
def test_plain_mlm_settings_still_apply(override, field, value):
    config = MLMConfig().with_overrides([override])
    got = getattr(config, field)
    assert (got["fp32"] if field == "learning_rates" else got) == value


def test_a_bad_mlm_learning_rate_is_one_line_naming_it(tmp_path, capsys):
    assert main(["compare", "--model", "bert", "--run-dir", str(tmp_path / "c"),
                 "--set", "mlm.learning_rates.fp32=abc"]) == 2
    assert "mlm.learning_rates.fp32" in _error(capsys)
    assert not (tmp_path / "c").exists()


# ------------------------------------------------------------------ what is reused


BERT_SMALL = ["mlm.steps=2", "mlm.hidden_size=16", "mlm.heads=2", "mlm.eval_batches=1",
              "mlm.warmup_steps=1", "mlm.seq_len=16", "mlm.min_len=8", "mlm.batch_size=4"]


def _compare(tmp: Path, run_dir: Path, *extra: str) -> List[str]:
    return ["compare", "--config", "tiny", "--data", str(tmp / "text.txt"), "--regimes",
            "fp32", "unit-fp32", "--run-dir", str(run_dir), "--quiet", "--set", *SMALL,
            *extra]


def _bert_compare(tmp: Path, run_dir: Path) -> List[str]:
    return ["compare", "--model", "bert", "--regimes", "fp32", "--seeds", "1", "--quiet",
            "--data", str(tmp / "text.txt"), "--run-dir", str(run_dir), "--set", *BERT_SMALL]


def _sweep(tmp: Path, run_dir: Path) -> List[str]:
    return ["sweep", "--config", "tiny", "--data", str(tmp / "text.txt"), "--models", "plain",
            "--widths", "32", "--log2-lr", "plain=-6:-5", "--run-dir", str(run_dir),
            "--quiet", "--set", *SMALL]


def _swap_two_characters(tokenizer: Path) -> None:
    saved = json.loads(tokenizer.read_text(encoding="utf-8"))
    saved["chars"][0], saved["chars"][1] = saved["chars"][1], saved["chars"][0]
    tokenizer.write_text(json.dumps(saved), encoding="utf-8")


@pytest.mark.parametrize("command, finished", [("compare", "unit-fp32"),
                                               ("bert", "fp32-seed0"),
                                               ("sweep", "plain/w32-d2/log2lr-5")])
def test_a_finished_run_whose_tokenizer_was_edited_is_not_reused(command, finished, tmp_path,
                                                                  capsys):
    _text(tmp_path)
    argv = {"compare": _compare, "bert": _bert_compare, "sweep": _sweep}[command](
        tmp_path, tmp_path / "c")
    assert main(argv) == 0
    directory = tmp_path / "c" / finished
    assert directory.is_dir(), sorted(p.name for p in (tmp_path / "c").iterdir())
    _swap_two_characters(directory / "tokenizer.json")
    capsys.readouterr()
    assert main(argv) == 2
    error = _error(capsys)
    assert str(directory) in error and "tokenizer.json" in error


@pytest.mark.parametrize("command", ["compare", "bert", "sweep"])
def test_finished_runs_of_other_text_are_not_reused(command, tmp_path, capsys):
    _text(tmp_path)
    argv = {"compare": _compare, "bert": _bert_compare, "sweep": _sweep}[command](
        tmp_path, tmp_path / "c")
    assert main(argv) == 0
    _text(tmp_path, TEXT.replace("fox", "cat"))
    capsys.readouterr()
    assert main(argv) == 2
    error = _error(capsys)
    assert "text it trained on" in error and str(tmp_path / "c") in error


def _terminate_at_row(monkeypatch, directory_name: str, step: int) -> None:
    """SIGTERM to this process once ``directory_name``'s run has logged ``step``."""
    import signal

    from ipu_unit_scaling.training import run_records as rundir

    real_write = rundir.MetricsLog.write

    def write_then_terminate(self, row):
        real_write(self, row)
        if self.path.parent.name == directory_name and row.get("step") == step:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(rundir.MetricsLog, "write", write_then_terminate)


@pytest.mark.parametrize("command, stopped", [("compare", "unit-fp32"), ("bert", "fp32-seed0"),
                                              ("sweep", "log2lr-5")])
def test_a_stopped_comparison_says_to_run_it_again(command, stopped, tmp_path, capsys,
                                                    monkeypatch):
    _text(tmp_path)
    run_dir = tmp_path / "c"
    argv = {"compare": _compare, "bert": _bert_compare, "sweep": _sweep}[command](
        tmp_path, run_dir)
    _terminate_at_row(monkeypatch, stopped, 1)
    assert main(argv) == 143
    message = capsys.readouterr().err.strip()
    assert "SIGTERM: interrupted at step 1" in message
    assert "train --resume" not in message  # which would leave the rest of it undone
    said = "compare" if command == "bert" else command
    assert f"run the same {said} command again" in message and str(run_dir) in message
    monkeypatch.undo()
    assert main(argv) == 0

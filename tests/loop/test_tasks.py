"""One training loop for every task: a run of the causal LM and one of the masked LM get the same
run directory, checkpoints and resume; a resume after a kill continues bit for bit; readers of
runs know which task a run trained."""
from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from helpers import ONE_IPU

from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.apps.mlm import MLMConfig, run_config
from ipu_unit_scaling.loop.run_session import TrainingSession
from ipu_unit_scaling.loop.tasks import CausalLM, MaskedLM, Task, read_task
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.ops.ipu_lowering import torch_numerics
from ipu_unit_scaling.training.config_files import ConfigError
from ipu_unit_scaling.training.data import load_corpus
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_directory import METRIC_FIELDS
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child"),
              pytest.mark.usefixtures("one_thread")]

# Checkpoints at steps 2 and 4, evaluations at 3 and 6: a kill at step 3 loses a step.
STEPS = ["training.steps=6", "training.checkpoint_interval=2", "training.eval_interval=3",
         "training.eval_batches=1", "training.warmup_steps=2"]
TINY_MLM = ["mlm.hidden_size=32", "mlm.depth=1", "mlm.heads=2", "mlm.seq_len=24", "mlm.min_len=8",
            "mlm.batch_size=4", "mlm.steps=6", "mlm.warmup_steps=2", "mlm.eval_interval=3",
            "mlm.eval_batches=1"]


def causal_lm(data: Path) -> Tuple[Config, Task]:
    return load_config("tiny", [*ONE_IPU, f"data.path={data}", *STEPS]), CausalLM()


def masked_lm(data: Path, regime: str = "unit-fp8") -> Tuple[Config, Task]:
    settings = MLMConfig().with_setting("data", str(data)).with_overrides(TINY_MLM)
    corpus = load_corpus(settings.data, settings.val_fraction, settings.seq_len)
    config = run_config(settings, regime, 0, corpus.tokenizer.vocab_size)
    config = replace(config, training=replace(config.training, checkpoint_interval=2))
    return config, MaskedLM(settings.min_len, settings.mask_prob)


TASKS: Dict[str, Callable[[Path], Tuple[Config, Task]]] = {
    "causal-lm": causal_lm, "masked-lm": masked_lm}


def numbers(run_dir: Path) -> List[Dict[str, str]]:
    """Every metrics row but its clock columns."""
    return [{key: value for key, value in row.items() if key not in ("tokens_per_s", "elapsed_s")}
            for row in read_metrics(run_dir)]


def killed_after_step(config: Config, task: Task, run_dir: Path, step: int) -> None:
    """Train in a forked child that SIGKILLs itself once the row of ``step`` is written."""
    pid = os.fork()
    if pid == 0:
        try:
            real_log = TrainingSession.log_step

            def log_then_die(self: Any, lr: float, loss: float, val_loss: Any) -> None:
                real_log(self, lr, loss, val_loss)
                if self.step == step:
                    os.kill(os.getpid(), signal.SIGKILL)

            TrainingSession.log_step = log_then_die  # type: ignore[method-assign]
            train(config, run_dir, task=task, quiet=True)
        finally:
            os._exit(70)  # only reached if the kill was not
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.parametrize("name", TASKS)
def test_a_resume_after_a_kill_continues_bit_for_bit(name, data, tmp_path):
    config, task = TASKS[name](data)
    reference = tmp_path / "reference"
    train(config, reference, task=task, quiet=True)
    killed = tmp_path / "killed"
    killed_after_step(config, task, killed, 3)
    assert load_checkpoint(killed / "checkpoint.pt")["step"] == 2
    assert len(read_metrics(killed)) == 3  # the row of the lost step is there before the resume

    summary = train(None, killed, resume=True, quiet=True)  # the run's own config and task
    assert summary.status == "completed" and summary.task == task.name
    assert numbers(killed) == numbers(reference)
    assert len(numbers(killed)) == 6
    assert list(read_metrics(killed)[0]) == [*METRIC_FIELDS, *task.metric_columns]
    final = load_checkpoint(killed / "checkpoint.pt")
    expected = load_checkpoint(reference / "checkpoint.pt")
    assert final["step"] == 6 and final["task"] == task.settings()
    for key, tensor in expected["model"].items():
        assert torch.equal(final["model"][key], tensor), key
    assert torch.equal(final["batch_rng"], expected["batch_rng"])  # the same data position
    assert read_task(killed).settings() == task.settings()


def test_each_task_records_itself_and_the_masked_lm_its_accuracy(data, tmp_path):
    for name, make in TASKS.items():
        config, task = make(data)
        run_dir = tmp_path / name
        summary = train(config, run_dir, task=task, quiet=True)
        assert summary.task == name
        # A causal-LM run looks as runs always have: no task.json, the loop's own columns.
        assert (run_dir / "task.json").exists() == (name == "masked-lm")
        rows = read_metrics(run_dir)
        if name == "masked-lm":
            assert [row["val_accuracy"] != "" for row in rows] == \
                [row["val_loss"] != "" for row in rows]
            assert summary.final_val_metrics["accuracy"] == float(rows[-1]["val_accuracy"])
        else:
            assert "val_accuracy" not in rows[0] and summary.final_val_metrics == {}


def test_compare_bert_stopped_by_sigterm_resumes_where_it_stopped(data, tmp_path, capsys,
                                                                 monkeypatch):
    argv = ["compare", "--model", "bert", "--regimes", "fp32", "unit-fp8", "--seeds", "1",
            "--data", str(data), "--set", *TINY_MLM, "--quiet", "--run-dir"]
    assert main([*argv, str(tmp_path / "reference")]) == 0
    real_log = TrainingSession.log_step

    def terminate_at_step_3(self: Any, lr: float, loss: float, val_loss: Any) -> None:
        real_log(self, lr, loss, val_loss)
        if self.run.run_dir.name == "unit-fp8-seed0" and self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(TrainingSession, "log_step", terminate_at_step_3)
    stopped = tmp_path / "stopped"
    assert main([*argv, str(stopped)]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert f"interrupted at step 3; checkpoint: {stopped / 'unit-fp8-seed0'}" in err
    assert load_checkpoint(stopped / "unit-fp8-seed0" / "checkpoint.pt")["step"] == 3
    monkeypatch.undo()

    assert main([*argv[:-2], "--run-dir", str(stopped)]) == 0  # not quiet: says what it does
    out = capsys.readouterr().out
    assert "fp32 seed 0: reusing the finished run" in out
    assert "unit-fp8 seed 0: resuming" in out and "at step 3 of 6" in out
    for regime in ("fp32", "unit-fp8"):
        assert numbers(stopped / f"{regime}-seed0") == numbers(tmp_path / "reference" /
                                                                f"{regime}-seed0")
    table = json.loads((stopped / "compare.json").read_text())["regimes"]
    expected = json.loads((tmp_path / "reference" / "compare.json").read_text())["regimes"]
    for row, reference in zip(table, expected):
        assert (row["val_loss"], row["val_accuracy"]) == \
            (reference["val_loss"], reference["val_accuracy"])


def test_compare_bert_refuses_a_run_trained_with_other_settings(data, tmp_path, capsys):
    argv = ["compare", "--model", "bert", "--regimes", "fp32", "--seeds", "1", "--data",
            str(data), "--quiet", "--run-dir", str(tmp_path / "run"), "--set", *TINY_MLM]
    assert main(argv) == 0
    before = (tmp_path / "run" / "fp32-seed0" / "checkpoint.pt").read_bytes()
    assert main([*argv, "mlm.mask_prob=0.3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained with other settings" in err and "mask_prob" in err
    assert (tmp_path / "run" / "fp32-seed0" / "checkpoint.pt").read_bytes() == before


def test_a_masked_lm_run_resumes_with_train_and_readers_refuse_it(data, tmp_path, capsys):
    config, task = masked_lm(data)
    run_dir = tmp_path / "run"
    train(config, run_dir, task=task, quiet=True)
    assert main(["train", "--resume", str(run_dir), "--quiet", "--set",
                 "training.steps=8"]) == 0
    rows = read_metrics(run_dir)
    assert len(rows) == 8 and rows[-1]["val_accuracy"]  # still the masked LM
    for argv, action in ((["evaluate", str(run_dir)], "evaluate"),
                         (["sample", str(run_dir)], "sample"),
                         (["train", "--init-from", str(run_dir), "--run-dir",
                           str(tmp_path / "ft")], "fine-tune from")):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"cannot {action} {run_dir}: it trained a masked-lm" \
            in err, err
    # Its task.json is what tells a resume the task: damaged or gone, the resume is refused.
    (run_dir / "task.json").write_text('{"name": "masked-lm", "min_len": ')
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2
    assert "task.json is damaged" in capsys.readouterr().err
    (run_dir / "task.json").unlink()
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its checkpoint.pt trained {'name': 'masked-lm'" in err


def test_the_masked_lm_refuses_what_its_encoder_cannot_be(data):
    config, task = masked_lm(data)
    task.check(config, "cpu")
    with pytest.raises(ConfigError, match="popxl trains the GPT"):
        task.check(config, "popxl")
    config = replace(config, model=replace(config.model, bias=True))
    with pytest.raises(ConfigError, match="model.bias"):
        task.check(config, "cpu")
    with pytest.raises(ConfigError, match="min_len"):
        MaskedLM(min_len=100).check(masked_lm(data)[0], "cpu")


def test_the_masked_lm_trains_on_the_emulator_as_on_the_cpu(data, tmp_path):
    config, task = masked_lm(data, "unit-fp32")
    losses = {}
    for backend in ("cpu", "emulator"):
        config = replace(config, backend=backend)
        # The loop and the backend are under test, not the lowering: torch's GELU in the trace.
        with torch_numerics():
            summary = train(config, tmp_path / backend, task=task, quiet=True)
        assert summary.backend == backend
        losses[backend] = [float(row["train_loss"]) for row in read_metrics(tmp_path / backend)]
    # The emulator's gradients come from the traced graph: the same up to float32 rounding.
    assert losses["emulator"] == pytest.approx(losses["cpu"], rel=1e-5)

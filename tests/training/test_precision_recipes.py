"""Every FP8 recipe trains the default GPT through the one loop; a delayed-scaling run killed
and resumed continues its amax history bit for bit; ``--set precision.fp8.*`` is validated."""
from __future__ import annotations

import math
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any, List

import pytest
import torch
from helpers import ONE_IPU, TEXT, one_line_error, run

from ipu_unit_scaling.fp8.fp8_config import RECIPES
from ipu_unit_scaling.loop.run_session import TrainingSession
from ipu_unit_scaling.loop.training_loop import train
from ipu_unit_scaling.training.precision import RECIPE_NAMES, recipe_regimes, regime_config
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_records import load_checkpoint, read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(TEXT * 4, encoding="utf-8")
    return path


def recipe_config(recipe: str, data: Path, *settings: str) -> Config:
    """The default GPT and run, a few steps long, in ``recipe``."""
    config = load_config(None, [*ONE_IPU, f"data.path={data}", "training.steps=4",
                                "training.warmup_steps=1", "training.eval_interval=4",
                                "training.eval_batches=1", "training.log_interval=1", *settings])
    fp8 = config.precision.fp8.with_recipe(recipe)
    return replace(config, precision=replace(config.precision, dtype="fp8", fp8=fp8))


def losses(run_dir: Path) -> List[str]:
    return [row["train_loss"] for row in read_metrics(run_dir)]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_trains_the_default_gpt_without_nan(recipe, data, tmp_path):
    summary = train(recipe_config(recipe, data), tmp_path / recipe, quiet=True)
    assert summary.status == "completed"
    values = [float(loss) for loss in losses(tmp_path / recipe)]
    assert len(values) == 4 and all(math.isfinite(v) for v in values)


def killed_after_step(config: Config, run_dir: Path, step: int) -> None:
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
            train(config, run_dir, quiet=True)
        finally:
            os._exit(70)  # only reached if the kill was not
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")
@pytest.mark.parametrize("reduction", ["max", "most_recent"])
def test_a_delayed_run_killed_and_resumed_continues_its_amax_history(reduction, data,
                                                                     tmp_path):
    config = recipe_config("delayed", data, "training.steps=6",
                           "training.checkpoint_interval=2", "precision.fp8.scaling=delayed",
                           "precision.fp8.amax_history_length=4",
                           f"precision.fp8.amax_reduction={reduction}")
    reference = tmp_path / "reference"
    train(config, reference, quiet=True)
    killed = tmp_path / "killed"
    killed_after_step(config, killed, 3)
    assert load_checkpoint(killed / "checkpoint.pt")["step"] == 2
    summary = train(None, killed, resume=True, quiet=True)
    assert summary.status == "completed"
    assert losses(killed) == losses(reference) and len(losses(killed)) == 6
    final = load_checkpoint(killed / "checkpoint.pt")["model"]
    expected = load_checkpoint(reference / "checkpoint.pt")["model"]
    histories = [key for key in expected if key.endswith("amax_history")]
    assert histories and all(bool(expected[key].any()) for key in histories)
    for key in histories:
        assert torch.equal(final[key], expected[key]), key


def test_recipe_regimes_name_each_recipe_on_both_models():
    regimes = recipe_regimes(["static", "amax", "mx"])
    assert regimes == ["fp32", "unit-fp32", "fp8-naive", "unit-fp8", "fp8-amax",
                       "unit-fp8-amax", "fp8-mx", "unit-fp8-mx"]
    config = regime_config(load_config(None, []), "unit-fp8-mx")
    assert config.model.unit_scaled and config.precision.fp8.scaling == "mx"
    assert config.precision.fp8.activation_format == "E4M3FN"
    assert config.training.learning_rate == config.compare.learning_rates["unit-fp8-amax"]
    assert set(RECIPE_NAMES) == set(RECIPES)


@pytest.mark.parametrize("setting,words", [
    ("precision.fp8.scaling=mxx", "precision.fp8.scaling"),
    ("precision.fp8.activation_format=E2M1", "use scaling 'mx' or 'nvfp4'"),
    ("precision.fp8.block_size=64", "has no blocks"),
])
def test_bad_fp8_settings_on_the_command_line_are_one_line(setting, words, capsys, tmp_path):
    code, _, err = run(capsys, "train", "--run-dir", str(tmp_path / "run"), "--quiet",
                       "--set", setting)
    assert code != 0 and one_line_error(err) and words in err, err
    assert not (tmp_path / "run").exists()


def test_mx_on_the_command_line_validates(tmp_path):
    config = load_config(None, ["precision.fp8.scaling=mx", "precision.fp8.scale_rounding=up"])
    assert config.precision.fp8.group_size == 32


def test_the_command_line_knows_every_recipe():
    from ipu_unit_scaling.training.config_names import FP8_RECIPE_NAMES

    assert FP8_RECIPE_NAMES == tuple(RECIPES)


def test_the_popxl_backend_refuses_recipes_it_cannot_cast():
    from ipu_unit_scaling.backends.popxl.popxl_training import check_config
    from ipu_unit_scaling.training.config_files import ConfigError

    config = load_config(None, ["precision.fp8.scaling=delayed", "ipu.ipus_per_replica=1",
                                "ipu.layers_per_ipu=[-1]"])
    with pytest.raises(ConfigError, match="precision.fp8.scaling"):
        check_config(config)


@pytest.mark.parametrize("recipe", ["delayed", "nvfp4"])
def test_a_recipe_run_is_evaluated_in_other_precisions(recipe, data, tmp_path, capsys):
    """evaluate: the run's own recipe, then the per-tensor ones (the delayed history is left
    out of their models; an FP4 run's formats go back to the defaults)."""
    from ipu_unit_scaling.training.inference import precision_config, precision_of

    config = recipe_config(recipe, data, "training.steps=2")
    train(config, tmp_path / "run", quiet=True)
    assert precision_of(config) == f"fp8-{config.precision.fp8.scaling}"
    assert precision_config(config, precision_of(config)) == config
    assert precision_config(config, "fp8-amax").precision.fp8.scaling == "amax"
    code, out, err = run(capsys, "evaluate", tmp_path / "run", "--precision", "fp32",
                         "fp8-amax", "fp8-static")
    assert code == 0, err
    assert "| fp8-amax |" in out and "| fp8-static |" in out

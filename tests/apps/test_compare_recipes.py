"""``compare --recipes``: fp32 and each FP8 recipe, on the plain and the unit-scaled GPT."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import ONE_IPU, TEXT, one_line_error, run

from ipu_unit_scaling.training.run_config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = [*ONE_IPU, "training.steps=2", "training.eval_batches=1"]


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_compare_trains_each_recipe_on_both_models(capsys, data, tmp_path):
    run_dir = tmp_path / "compare"
    argv = ["compare", "--config", "tiny", "--data", data, "--run-dir", run_dir, "--quiet",
            "--set", *FAST, "--recipes", "mx", "block"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    table = json.loads((run_dir / "compare.json").read_text())["regimes"]
    assert [row["regime"] for row in table] == [
        "fp32", "unit-fp32", "fp8-mx", "unit-fp8-mx", "fp8-block", "unit-fp8-block"]
    assert all(row["status"] == "completed" for row in table)
    precisions = {row["regime"]: row["precision"] for row in table}
    assert precisions["unit-fp8-mx"] == "mx E4M3FN/E5M2"
    assert precisions["fp8-block"] == "block F143/F152"
    assert all(row["gap_to_fp32_percent"] is not None for row in table)
    models = {row["regime"]: row["model"] for row in table}
    assert models["fp8-mx"] != models["unit-fp8-mx"]
    saved = load_config(run_dir / "unit-fp8-mx" / "config.yaml")
    assert saved.model.unit_scaled and saved.precision.fp8.scaling == "mx"
    # Run again: the finished regimes are reused, not refused as foreign directories.
    code, _, err = run(capsys, *argv)
    assert code == 0, err


def test_recipes_and_regimes_together_are_refused(capsys, tmp_path):
    code, _, err = run(capsys, "compare", "--run-dir", tmp_path / "c", "--regimes", "fp32",
                       "--recipes", "mx")
    assert code != 0 and one_line_error(err) and "--recipes" in err


def test_an_unknown_recipe_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "compare", "--run-dir", tmp_path / "c", "--recipes", "mx9")
    assert code != 0 and "mx9" in err and "nvfp4" in err


@pytest.mark.parametrize("settings,recipes", [
    (["precision.fp8.block_size=64"], ["amax", "block"]),  # the base config's scaling is amax
    (["precision.fp8.scaling=block", "precision.fp8.block_size=64"], ["block"]),
])
def test_a_block_size_given_with_recipes_is_the_one_that_runs(settings, recipes, capsys,
                                                              data, tmp_path):
    run_dir = tmp_path / "compare"
    code, _, err = run(capsys, "compare", "--config", "tiny", "--data", data, "--run-dir",
                       run_dir, "--quiet", "--set", *FAST, "training.steps=1", *settings,
                       "--recipes", *recipes)
    assert code == 0, err
    for regime in ("fp8-block", "unit-fp8-block"):
        assert load_config(run_dir / regime / "config.yaml").precision.fp8.block_size == 64
    others = [r for r in ("fp8-amax", "unit-fp8-amax", "fp32") if (run_dir / r).is_dir()]
    for regime in others:
        assert load_config(run_dir / regime / "config.yaml").precision.fp8.block_size is None
    table = json.loads((run_dir / "compare.json").read_text())["regimes"]
    assert {row["regime"]: row["precision"] for row in table}["fp8-block"] == \
        "block 64 F143/F152"


@pytest.mark.parametrize("setting,words", [
    ("precision.fp8.scaling=mx", "recipe block sets it to 'block', not 'mx'"),
    ("precision.fp8.weight_format=F152", "recipe mx sets it to 'E4M3FN', not 'F152'"),
    ("precision.fp8.amax_history_length=4", "none of the recipes block mx reads it (only "
                                            "delayed reads it)"),
    ("precision.fp8.block_size=0", "recipe block: block_size: got 0"),
])
def test_a_setting_a_recipe_would_replace_or_ignore_is_refused(setting, words, capsys,
                                                               tmp_path):
    run_dir = tmp_path / "c"
    code, out, err = run(capsys, "compare", "--config", "tiny", "--run-dir", run_dir,
                         "--set", setting, "--recipes", "block", "mx")
    assert code == 2 and out == "" and one_line_error(err) and words in err, err
    assert not run_dir.exists()

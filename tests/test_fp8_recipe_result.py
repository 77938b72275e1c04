"""scripts/fp8_recipe_result.py: each FP8 run's gap is to the FP32 run of its own model."""
from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import ROOT


@pytest.fixture(scope="module")
def script():
    # scripts/ is not a package: load the script by path.
    spec = importlib.util.spec_from_file_location(
        "fp8_recipe_result", ROOT / "scripts" / "fp8_recipe_result.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(regime, losses):
    return {"regime": regime, "seeds": [0, 1], "losses": losses}


def test_gaps_are_to_each_models_own_fp32_run(script, tmp_path):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"regimes": [
        row("fp32", [2.0, 4.0]), row("unit-fp32", [1.0, 2.0]),
        row("fp8-mx", [2.2, 4.0]), row("unit-fp8-mx", [1.0, 2.1]),
        row("fp8-naive", [3.0, 5.0]), row("unit-fp8", [1.0, 2.0])]}))
    gaps = script.recipe_gaps([path])
    assert gaps["mx"]["plain"] == pytest.approx([10.0, 0.0])
    assert gaps["mx"]["unit"] == pytest.approx([0.0, 5.0])
    assert gaps["static"]["plain"] == pytest.approx([50.0, 25.0])
    assert "| static | +37.50% ± 17.68% | +0.00% ± 0.00% |" in script.table(gaps)
    script.figure(gaps, tmp_path / "gaps.png")
    assert (tmp_path / "gaps.png").stat().st_size > 0

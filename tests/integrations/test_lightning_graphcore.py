"""Lightning's IPU support through ``ipu-unit-scaling emulate``: lightning-graphcore's
``IPUAccelerator``/``IPUStrategy``/``IPUPrecision`` and Lightning 2.0's own
``accelerator="ipu"`` fit, validate and test a classifier pipelined over two IPUs with
``poptorch.BeginBlock`` in "16-mixed" precision (``lightning_program.py``, run unchanged), and
what it saves after fitting loads with ``torch.load``'s weights-only reader.

Their pins differ from the project's environment (lightning 2.0.9.post0 and lightning-graphcore
0.1.0), so they live in a virtual environment of their own, which ``bash .ci/lightning-graphcore``
creates and then runs this file in. Elsewhere the tests run there through a subprocess when that
environment exists (``IPU_UNIT_SCALING_LIGHTNING_VENV`` names another), and are skipped when it
does not.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).resolve().parent / "lightning_program.py"
VENV = Path(os.environ.get(
    "IPU_UNIT_SCALING_LIGHTNING_VENV",
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "ipu-unit-scaling" / "venv-lightning-graphcore"))
EPOCHS = 3
STEPS_PER_EPOCH = 16  # 512 samples, micro-batches of 8, 4 accumulated a step

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _python() -> str:
    """An interpreter with lightning-graphcore: this one, or the environment's."""
    if importlib.util.find_spec("lightning_graphcore") is not None:
        return sys.executable
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"lightning-graphcore's environment ({VENV}) is absent: "
                    "bash .ci/lightning-graphcore creates it")
    return str(python)


def _fit(strategy: str, save: Path) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [_python(), "-m", "ipu_unit_scaling.apps.cli", "emulate", str(PROGRAM),
         "--strategy", strategy, "--epochs", str(EPOCHS), "--save", str(save)],
        cwd=save, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _losses(output: str) -> List[float]:
    return [float(v) for v in re.findall(r"^loss (\S+)$", output, re.M)]


def _metric(output: str, stage: str, name: str) -> float:
    match = re.search(rf"^{stage} \[{{'{name}': (\S+)}}\]$", output, re.M)
    assert match, output
    return float(match.group(1))


@pytest.mark.parametrize("strategy", ["graphcore", "lightning"])
def test_a_pipelined_half_precision_module_fits_validates_and_tests(tmp_path, strategy):
    output = _fit(strategy, tmp_path)
    losses = _losses(output)
    assert len(losses) == EPOCHS * STEPS_PER_EPOCH, output
    assert all(math.isfinite(loss) for loss in losses), losses
    first, last = losses[:STEPS_PER_EPOCH], losses[-STEPS_PER_EPOCH:]
    # Falling: the last epoch's mean well below the first's (log 4, about 1.39, is chance).
    assert sum(last) / len(last) < 0.8 * sum(first) / len(first), losses
    accuracy = _metric(output, "validate", "val_accuracy")
    assert 0.5 < accuracy <= 1, output  # four classes: chance is a quarter
    assert math.isfinite(_metric(output, "test", "test_loss"))
    # What a user saves after fitting loads with the weights-only reader (torch.load's
    # default since torch 2.6), buffers included.
    state = torch.load(tmp_path / "state_dict.pt", weights_only=True)
    assert {type(v) for v in state.values()} == {torch.Tensor}
    assert state["norm.running_var"].dtype == torch.float16
    assert state["norm.num_batches_tracked"].item() > 0
    checkpoint = torch.load(tmp_path / "trained.ckpt", weights_only=True)
    assert checkpoint["state_dict"].keys() == state.keys()

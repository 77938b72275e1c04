"""FP8 through Optimum Graphcore's ``IPUTrainer`` under ``ipu-unit-scaling emulate``, in the
environment Optimum's users install (``optimum-graphcore==0.7.1``, transformers 4.29.2; created
by ``.ci/optimum-graphcore``): ``optimum_conversion_program.py``, the guide's recipe, with a
BERT classifier and a GPT-2 causal LM.

Skipped where that environment is absent (the main environment's transformers 5 cannot
install beside Optimum Graphcore 0.7.1, which pins 4.29.2).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
from helpers import OPTIMUM_PYTHON, OPTIMUM_VENV, ROOT, optimum_graphcore_installed

VENV, PYTHON = OPTIMUM_VENV, OPTIMUM_PYTHON
PROGRAM = ROOT / "tests" / "transforms" / "optimum_conversion_program.py"


pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(not optimum_graphcore_installed(),
                       reason=f"optimum-graphcore is not installed in {VENV} (it pins "
                       "transformers 4.29.2, so it lives in an environment of its own: "
                       "bash .ci/optimum-graphcore creates it)"),
]


def _run(args: List[str], out: Path) -> Dict[str, List[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run([str(PYTHON), "-m", "ipu_unit_scaling", "emulate", str(PROGRAM),
                           *args], cwd=out, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    lines: Dict[str, List[str]] = {}
    for line in done.stdout.splitlines():
        name, _, value = line.partition(" ")
        lines.setdefault(name, []).append(value)
    return lines


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_an_fp8_bert_trains_pipelined_with_its_fp8_layers(tmp_path: Path, fp16: bool) -> None:
    """Converted after `to_pipelined`, the FP8 layers are the trained model's: all 14 linears
    (12 in the two layers, the pooler, the classifier) change, and the encoder layers carry
    PopTorch's blocks. Before, converting the transformers model let `to_pipelined` rebuild it
    from its config: no FP8 layer was trained, and nothing said so."""
    out = _run(["--conversion", "fp8", *(["--fp16"] if fp16 else [])], tmp_path)
    losses = [float(v) for v in out["loss"]]
    assert len(losses) == 4 and all(loss == loss and abs(loss) < 1e3 for loss in losses)
    assert out["converted"] == ["14"]
    assert out["changed"] == ["14 of 14"]
    assert out["pipelined"] == ["True"]
    assert out["model_class"] == ["FP8PipelinedBertForSequenceClassification"]
    assert out["reloaded_equal"] == ["True"]  # save_model walked it back and saved it


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_a_unit_scaled_bert_trains_pipelined_with_its_unit_scaled_layers(
        tmp_path: Path, fp16: bool) -> None:
    """unit_scale(keep_structure=True) of the pipelined BERT, given the trainer's batch as
    example inputs, trains through IPUTrainer: PopTorch binds the trainer's keyword batch to
    the converted forward's parameters, which are the original forward's (they had been
    (*args, **kwargs), and the compile refused the call: 'argument 0 was a tensor when traced,
    not None'). Every weight of its unit-scaled layers changes, and save_model's files reload."""
    out = _run(["--conversion", "unit_scale", *(["--fp16"] if fp16 else [])], tmp_path)
    losses = [float(v) for v in out["loss"]]
    assert len(losses) == 4 and all(loss == loss and abs(loss) < 1e3 for loss in losses)
    converted = int(out["converted"][0])
    assert converted >= 20, out["converted"]
    changed, _, total = out["changed"][0].partition(" of ")
    assert int(total) > 0 and changed == total, out["changed"]
    assert out["pipelined"] == ["True"]
    assert out["model_class"] == ["UnitScaledPipelinedBertForSequenceClassification"]
    assert out["reloaded_equal"] == ["True"]


def test_an_fp8_gpt2_trains_with_its_conv1d_layers_in_fp8(tmp_path: Path) -> None:
    """GPT-2's eight Conv1D projections and its head (tied to the embedding) are FP8 layers
    of the trained model; before, only the head was converted."""
    out = _run(["--conversion", "fp8", "--model", "gpt2"], tmp_path)
    losses = [float(v) for v in out["loss"]]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert out["converted"] == ["9"]
    assert out["changed"] == ["9 of 9"]
    assert out["pipelined"] == ["True"]
    assert out["reloaded_equal"] == ["True"]


def test_fp8_before_to_pipelined_is_refused_in_one_line(tmp_path: Path) -> None:
    out = _run(["--refused", "fp8"], tmp_path)
    assert out["refused"] == [
        "KeyError 'FP8BertForSequenceClassification pipelined version not found in registry.'"]

"""Optimum Graphcore's ``IPUTrainer``, unchanged and unpatched, through ``ipu-unit-scaling
emulate``: ``optimum_program.py`` run in the environment Optimum's users install
(``optimum-graphcore==0.7.1`` pins transformers 4.29.2, so it has an environment of its own:
``.ci/optimum-graphcore`` creates it). Skipped where that environment is absent.

- a tiny BERT classifier pipelined over 2 IPUs, gradient accumulation 4, 2 device iterations,
  in float16, replicated twice: finite, falling losses; evaluate; ``save_model`` and a
  reload that gives the saved weights;
- a tiny GPT-2 causal LM (its tied head back on IPU 0: 3 pipeline stages), trained, saved and
  reloaded, then Optimum's text-generation pipeline, whose greedy tokens through the stand-in
  equal those of Optimum's own run of the same decoder as a plain module on the host.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
from helpers import OPTIMUM_PYTHON, OPTIMUM_VENV, ROOT, optimum_graphcore_installed

VENV, PYTHON = OPTIMUM_VENV, OPTIMUM_PYTHON
PROGRAM = ROOT / "tests" / "integrations" / "optimum_program.py"


pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.skipif(not optimum_graphcore_installed(),
                       reason=f"optimum-graphcore is not installed in {VENV} "
                       "(bash .ci/optimum-graphcore creates that environment)"),
]


def _run(args: List[str], out: Path) -> Dict[str, List[str]]:
    """Run the program under emulate in the Optimum environment; its ``name value`` lines."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's stand-ins, whatever the venv installed
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    done = subprocess.run([str(PYTHON), "-m", "ipu_unit_scaling", "emulate", str(PROGRAM),
                           *args, "--out", str(out)],
                          cwd=out, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "emulating an IPU-POD16 (16 Mk2 IPUs)" in done.stderr
    lines: Dict[str, List[str]] = {}
    for line in done.stdout.splitlines():
        match = re.match(r"^(\w+) (.*)$", line)
        if match:
            lines.setdefault(match.group(1), []).append(match.group(2))
    return lines


def _falling(losses: List[float]) -> bool:
    """The mean of the last three steps below that of the first three: single steps of a few
    samples are noisy."""
    return sum(losses[-3:]) < sum(losses[:3])


def test_bert_classifier_pipelined_fp16_replicated(tmp_path):
    lines = _run(["--task", "classification", "--steps", "8", "--fp16", "--replicas", "2"],
                 tmp_path)
    losses = [float(v) for v in lines["loss"]]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses), losses
    assert _falling(losses), losses
    assert math.isfinite(float(lines["eval_loss"][0]))
    assert 0.0 <= float(lines["eval_accuracy"][0]) <= 1.0
    assert lines["reloaded_equal"] == ["True"]
    assert {"config.json", "ipu_config.json", "pytorch_model.bin"} <= set(
        lines["saved_files"][0].split())


@pytest.mark.parametrize("precision", [[], ["--fp16", "--replicas", "2"]],
                         ids=["fp32", "fp16-replicated"])
def test_gpt2_causal_lm_trains_saves_reloads_and_generates(tmp_path, precision):
    lines = _run(["--task", "causal-lm", "--steps", "8", *precision], tmp_path)
    losses = [float(v) for v in lines["loss"]]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses), losses
    assert _falling(losses), losses
    assert math.isfinite(float(lines["eval_loss"][0]))
    assert lines["reloaded_equal"] == ["True"]
    generated = lines["generated"][0]
    assert generated.startswith("[3, 4, 5, "), generated  # the prompt, then new tokens
    assert generated == lines["generated_without_poptorch"][0]

"""The memory estimate of a training step, and the refusal of configs that cannot fit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import ONE_IPU as FAST
from helpers import ROOT

import ipu_unit_scaling.training.memory as memory
from ipu_unit_scaling.apps.cli import main
from ipu_unit_scaling.training.memory import (
    check_memory,
    estimate_step_memory,
    format_bytes,
    parameter_count,
)
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import Config, load_config
from ipu_unit_scaling.training.run_directory import RunError


@pytest.mark.parametrize("overrides", [
    [], ["model.bias=true"], ["model.depth=3", "model.mlp_expansion=2"],
    ["model.hidden_size=48", "model.heads=3", "model.vocab_size=77", "model.seq_len=9"],
    ["model.unit_scaled=false", "model.bias=true"],
])
def test_parameter_count_is_that_of_the_built_model(overrides):
    config = load_config("tiny", FAST + overrides)
    model = build_model(config)
    assert parameter_count(config.model) == sum(p.numel() for p in model.parameters())


def test_the_estimate_grows_with_each_size():
    base = estimate_step_memory(load_config("tiny", FAST))
    for override in ("model.seq_len=64", "model.hidden_size=64", "model.depth=4",
                     "training.batch_size=32", "ipu.device_iterations=5"):
        bigger = estimate_step_memory(load_config("tiny", FAST + [override]))
        assert bigger.total > base.total, override
    # Attention scores grow with the square of the sequence length.
    long = estimate_step_memory(load_config("tiny", FAST + ["model.seq_len=2048"]))
    longer = estimate_step_memory(load_config("tiny", FAST + ["model.seq_len=4096"]))
    assert longer.activations > 3.4 * long.activations


def test_a_config_that_cannot_fit_is_refused_before_anything_runs(capsys, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    status = main(["train", "--config", "tiny", "--run-dir", str(run_dir), "--set", *FAST,
                   "model.seq_len=40000"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    estimate = estimate_step_memory(load_config("tiny", FAST + ["model.seq_len=40000",
                                                       "model.vocab_size=103"]))
    assert f"one training step needs about {format_bytes(estimate.total)} (" in err
    assert f"more than the {format_bytes(memory.machine_memory())} of this machine" in err
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.csv").exists()

    # The same check against a machine of 1 MiB refuses even the tiny config...
    monkeypatch.setattr(memory, "machine_memory", lambda: 2**20)
    status = main(["train", "--config", "tiny", "--run-dir", str(tmp_path / "small"), "--set",
                   *FAST])
    assert status == 2 and "more than the 1.0 MiB of this machine" in capsys.readouterr().err
    # ...and where it fits, the log says what it needs.
    monkeypatch.setattr(memory, "machine_memory", lambda: 2**40)
    status = main(["train", "--config", "tiny", "--run-dir", str(tmp_path / "fits"), "--set",
                   *FAST, "training.steps=1"])
    out = capsys.readouterr().out
    assert status == 0 and "memory for one step: about " in out and "of 1.0 TiB" in out


def test_machine_memory_is_known_here():
    size = memory.machine_memory()
    assert size is None or size >= 2**27


# Peak resident memory of two training steps, above what the process held before the model.
MEASURE = """
import json, os, sys, torch
from ipu_unit_scaling.backends import build_training_model, make_optimizer
from ipu_unit_scaling.training.run_config import load_config
from ipu_unit_scaling.training.memory import estimate_step_memory
from ipu_unit_scaling.training.precision import build_model
torch.set_num_threads(1)
config = load_config("default", sys.argv[1:])
inputs = torch.randint(0, config.model.vocab_size, (config.samples_per_call, config.model.seq_len))
base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
model = build_model(config)
optimizer = make_optimizer(model.parameters(), config, "cpu")
wrapper = build_training_model(model, optimizer, config, "cpu")
for _ in range(2):
    wrapper(inputs, inputs)
# VmHWM, not ru_maxrss: the latter keeps the high-water mark of the parent this process was
# forked from (pytest's), which can be larger than this whole run.
status = open("/proc/self/status").read()
peak = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"estimate": estimate_step_memory(config).total, "used": peak - base}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_the_estimate_is_within_a_factor_of_two_of_a_real_step():
    overrides = ["model.vocab_size=103", "model.seq_len=384", "training.batch_size=8"]
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, *overrides], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300,
    )
    assert result.returncode == 0, result.stderr
    numbers = json.loads(result.stdout)
    assert 0.5 < numbers["estimate"] / numbers["used"] < 2.0, numbers


def test_a_data_file_too_big_to_encode_is_refused_before_it_is_read(capsys, tmp_path,
                                                                    monkeypatch):
    text = tmp_path / "big.txt"
    with open(text, "wb") as handle:  # sparse: 64 MiB on paper, nothing on disk
        handle.truncate(64 * 2**20)
    monkeypatch.setattr(memory, "machine_memory", lambda: 2**30)
    status = main(["train", "--config", "tiny", "--data", str(text), "--run-dir",
                   str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "has 64.0 MiB; reading and encoding it needs about 1.3 GiB, more than the 1.0 GiB" \
        in err


def test_a_given_model_is_not_judged_by_the_gpt_of_its_settings(monkeypatch):
    """The estimate counts the package's GPT; a model from model.factory is not that GPT, so
    it is neither refused nor described by it."""
    monkeypatch.setattr(memory, "machine_memory", lambda: 2**30)
    config = Config()
    config = replace(config, model=replace(config.model, hidden_size=2**20, heads=1))
    # (a GPT this wide fits nowhere)
    with pytest.raises(RunError):
        check_memory(config)
    config = replace(config, model=replace(config.model, factory="examples.library_decoder:build"))
    assert check_memory(config) == ("memory for one step: not estimated for a given model "
                                    "(examples.library_decoder:build)")

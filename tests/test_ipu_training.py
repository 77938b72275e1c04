"""PopTorch builds and runs: a 2-IPU pipelined trainingModel on the IPU Model.

Skipped where poptorch does not import (everywhere but a Poplar SDK environment).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from ipu_unit_scaling.config import load_config

pytestmark = pytest.mark.ipu


def _standin():
    spec = importlib.util.spec_from_file_location(
        "_standin", __file__.replace("test_ipu_training.py", "test_training_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_apply_to_a_real_poptorch_options():
    poptorch = pytest.importorskip("poptorch")
    from ipu_unit_scaling.ipu.options import build_options

    options = build_options(load_config("ipu-4"), use_ipu_model=True)
    assert isinstance(options, poptorch.Options)
    assert options.device_iterations == 4
    assert options.replication_factor == 2
    assert options.Training.gradient_accumulation == 16


def test_two_ipu_pipelined_training_model_on_ipu_model():
    pytest.importorskip("poptorch")
    from ipu_unit_scaling.backends import build_training_model, make_optimizer

    config = load_config("tiny", ["model.depth=2", "ipu.device_iterations=2",
                                  "ipu.executable_cache_dir=null", "training.steps=6"])
    torch.manual_seed(0)
    model = _standin().StandInGPT(depth=2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = make_optimizer(model.parameters(), config, backend="ipu_model")
    wrapper = build_training_model(model, optimizer, config, backend="ipu_model")
    assert [s.layers for s in wrapper.stages] == [(0,), (1,)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 17, (config.samples_per_call, 9), generator=generator)
    output, loss = wrapper(ids[:, :-1], ids[:, 1:])
    micro_batches = config.ipu.device_iterations * config.ipu.gradient_accumulation
    assert loss.shape == (micro_batches,)
    assert output.shape[0] == config.samples_per_call
    assert torch.isfinite(loss).all()
    wrapper.copy_weights_to_host()
    assert any(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    wrapper.destroy()

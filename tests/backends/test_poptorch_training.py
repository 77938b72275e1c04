"""PopTorch builds and trains the real unit-scaled decoder, pipelined over 2 IPUs of the IPU Model,
with the FP8 custom ops, and matches the emulator's numbers.

Skipped where poptorch does not import (everywhere but a Poplar SDK environment). The custom-op
library must be built (`cmake -S custom_ops -B custom_ops/build && cmake --build ...`) for the
FP8 cases.
"""
from __future__ import annotations

import copy

import pytest
import torch

from ipu_unit_scaling.training.run_config import load_config

pytestmark = pytest.mark.ipu


def _config(precision: str):
    return load_config("tiny", [
        f"precision.dtype={precision}", "model.depth=2", "model.hidden_size=16",
        "model.heads=2", "model.seq_len=8", "ipu.device_iterations=2",
        "ipu.executable_cache_dir=null", "training.optimizer=sgd",
        "training.learning_rate=0.05", "training.steps=6"])


def test_options_apply_to_a_real_poptorch_options():
    poptorch = pytest.importorskip("poptorch")
    from ipu_unit_scaling.backends.poptorch.poptorch_options import build_options

    options = build_options(load_config("ipu-4").ipu, use_ipu_model=True)
    assert isinstance(options, poptorch.Options)
    assert options.device_iterations == 4
    assert options.replication_factor == 2
    assert options.Training.gradient_accumulation == 16


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("fp8", 2e-2)])
def test_real_decoder_on_a_2_ipu_pipeline_matches_the_emulator(precision, tolerance,
                                                               step_losses):
    pytest.importorskip("poptorch")
    config = _config(precision)
    emulated = step_losses(copy.deepcopy(config), "emulator", 3)
    on_ipu_model = step_losses(config, "ipu_model", 3)
    assert torch.isfinite(on_ipu_model).all()
    assert torch.allclose(on_ipu_model, emulated, rtol=tolerance, atol=0)


def test_destroy_removes_the_pipeline_annotations():
    pytest.importorskip("poptorch")
    from ipu_unit_scaling.backends import build_training_model, make_optimizer
    from ipu_unit_scaling.training.precision import build_model

    config = _config("fp32")
    model = build_model(config)
    optimizer = make_optimizer(model.parameters(), config, backend="ipu_model")
    wrapper = build_training_model(model, optimizer, config, backend="ipu_model")
    assert [s.layers for s in wrapper.stages] == [(0,), (1,)]
    wrapper.destroy()
    hooks = [h for m in model.modules() for h in m._forward_pre_hooks.values()]
    assert not any(type(h).__module__.startswith("poptorch") for h in hooks)

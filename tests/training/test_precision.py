"""Regimes, the FP16 simulation and atomic checkpoints of the training loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import ipu_unit_scaling as uu
from ipu_unit_scaling.fp8 import FP8Linear
from ipu_unit_scaling.training.config_names import REGIMES
from ipu_unit_scaling.training.precision import (
    FP16Linear,
    build_model,
    regime_config,
    simulate_fp16,
)
from ipu_unit_scaling.training.run_config import load_config, validate
from ipu_unit_scaling.training.run_directory import RunError
from ipu_unit_scaling.training.run_records import load_checkpoint, save_checkpoint


def test_each_regime_sets_model_precision_scaling_and_its_learning_rate():
    config = load_config("tiny", ["compare.learning_rates.unit-fp8=0.5"])
    expected = {
        "fp32": (False, "unit", "fp32", None),
        "fp16": (False, "unit", "fp16", None),
        "fp8-naive": (False, "unit", "fp8", "static"),
        "fp8-amax": (False, "unit", "fp8", "amax"),
        "unit-fp32": (True, "unit", "fp32", None),
        "unit-fp16": (True, "unit", "fp16", None),
        "unit-fp8": (True, "unit", "fp8", "static"),
        "unit-fp8-amax": (True, "unit", "fp8", "amax"),
        "umup-fp32": (True, "u-mup", "fp32", None),
        "umup-fp16": (True, "u-mup", "fp16", None),
        "umup-fp8": (True, "u-mup", "fp8", "static"),
        "umup-fp8-amax": (True, "u-mup", "fp8", "amax"),
    }
    assert set(expected) == set(REGIMES)
    for regime, (unit, parametrization, dtype, scaling) in expected.items():
        cfg = regime_config(config, regime)
        assert cfg.model.unit_scaled is unit and cfg.precision.dtype == dtype
        assert cfg.model.parametrization == parametrization
        validate(cfg)  # each regime keeps only the model keys that apply to it
        if scaling:
            assert cfg.precision.fp8.scaling == scaling
        assert cfg.training.learning_rate == config.compare.learning_rates[regime]
    assert regime_config(config, "unit-fp8").training.learning_rate == 0.5
    assert config.model.unit_scaled is True  # the original is left alone
    umup = load_config("tiny", ["model.parametrization=u-mup", "model.residual_mult=2"])
    assert regime_config(umup, "unit-fp32").model.residual_mult == 1.0
    assert regime_config(umup, "umup-fp8").model.residual_mult == 2.0


@pytest.mark.parametrize("regime, linear_type", [
    ("fp32", nn.Linear), ("fp16", FP16Linear), ("unit-fp8", FP8Linear),
    ("fp8-amax", FP8Linear), ("unit-fp16", FP16Linear),
])
def test_models_are_built_in_the_regime_precision(regime, linear_type):
    config = regime_config(load_config("tiny", ["model.vocab_size=40"]), regime)
    model = build_model(config)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, linear_type) for m in linears)
    logits = model(torch.randint(0, 40, (2, 16)))
    assert logits.shape == (2, 16, 40) and torch.isfinite(logits).all()


def _f16(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy().astype(np.float16).astype(np.float64)


def test_fp16_linear_rounds_operands_and_output_like_float16():
    torch.manual_seed(0)
    plain = nn.Linear(24, 8, bias=False)
    fp16 = simulate_fp16(nn.Sequential(plain))[0]
    assert isinstance(fp16, FP16Linear) and fp16.weight is plain.weight
    x = torch.randn(5, 24) * 3
    out = fp16(x)
    reference = (_f16(x) @ _f16(plain.weight).T).astype(np.float16).astype(np.float64)
    # float32 accumulation may land one float16 step away from the float64 sum's rounding
    np.testing.assert_allclose(out.detach().numpy(), reference, rtol=2e-3, atol=1e-6)
    assert torch.equal(out, out.half().float())  # every value is a float16 value


def test_fp16_linear_overflows_and_underflows_without_loss_scaling():
    layer = FP16Linear.from_linear(nn.Linear(4, 4, bias=False))
    big = torch.full((1, 4), 1e5)  # beyond float16's max of 65504
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(1e5))
    assert not torch.isfinite(layer(big)).all()

    x = torch.randn(3, 4, requires_grad=True)
    layer(x).backward(torch.full((3, 4), 1e-9))  # below float16's smallest subnormal
    assert np.float16(1e-9) == 0
    assert torch.count_nonzero(x.grad) == 0 and torch.count_nonzero(layer.weight.grad) == 0


def test_unit_scaled_fp16_linear_keeps_the_unit_scaled_result():
    torch.manual_seed(1)
    unit = uu.Linear(64, 32, bias=False)
    fp16 = FP16Linear.from_linear(unit)
    x = torch.randn(10, 64)
    np.testing.assert_allclose(fp16(x).detach().numpy(), unit(x).detach().numpy(),
                               rtol=1e-2, atol=1e-2)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1, "model": {"w": torch.ones(3)}})
    assert load_checkpoint(path)["step"] == 1

    def broken_save(obj, stream):
        stream.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2, "model": {}})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1  # the old checkpoint survives whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temp left


def test_garbage_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(RunError, match="not a checkpoint of this package"):
        load_checkpoint(path)
    with pytest.raises(RunError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")

"""The PopXL model on real PopXL, compiled for the IPU Model, against the torch stand-in.

Skipped where ``popxl`` does not import (everywhere but a Poplar SDK environment). The same
model code runs in ``tests/backends/test_popxl_training.py`` on the stand-in
(``ipu_standins/popxl/``); here the real IR is built, compiled and
run once per test, and compared with the stand-in's numbers.
"""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import relative

import ipu_standins.popxl as popxl_standin
import ipu_unit_scaling as uu
from ipu_unit_scaling.backends.popxl import PopXLTrainingModel, loss_and_gradients
from ipu_unit_scaling.fp8 import FP8Config
from ipu_unit_scaling.training.precision import build_model
from ipu_unit_scaling.training.run_config import load_config

pytestmark = pytest.mark.ipu

VOCAB, SEQ = 11, 8


def tiny_decoder() -> uu.GPT:
    torch.manual_seed(0)
    return uu.GPT(vocab_size=VOCAB, hidden_size=16, depth=2, heads=2,
                                 seq_len=SEQ)


def batch(rows: int = 3):
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (rows, SEQ), generator=gen),
            torch.randint(0, VOCAB, (rows, SEQ), generator=gen))


def test_one_fp32_step_on_the_ipu_model_matches_the_reference():
    popxl = pytest.importorskip("popxl")
    model = tiny_decoder()
    real = loss_and_gradients(model, *batch(), xl=popxl, device="ipu_model")
    stand_in = loss_and_gradients(model, *batch(), xl=popxl_standin)
    assert real.loss == pytest.approx(stand_in.loss, rel=1e-4)
    torch.testing.assert_close(real.logits, stand_in.logits, rtol=1e-4, atol=1e-4)
    for name, grad in stand_in.gradients.items():
        torch.testing.assert_close(real.gradients[name], grad, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("scaling", ["amax", "static"])
def test_one_fp8_step_on_the_ipu_model_matches_the_reference(scaling):
    """Real float8 tensors and FP8 matmuls. The IPU accumulates FP8 products in half
    precision where the stand-in sums in float32, so gradients agree within FP8 rounding."""
    popxl = pytest.importorskip("popxl")
    model, config = tiny_decoder(), FP8Config(scaling=scaling)
    real = loss_and_gradients(model, *batch(), fp8=config, xl=popxl, device="ipu_model")
    stand_in = loss_and_gradients(model, *batch(), fp8=config, xl=popxl_standin)
    assert real.non_finite == stand_in.non_finite == 0
    assert real.loss == pytest.approx(stand_in.loss, rel=1e-2)
    for name, grad in stand_in.gradients.items():
        assert relative(real.gradients[name], grad) < 0.15, name


def test_a_training_call_on_the_ipu_model_matches_the_reference():
    """Two optimizer steps of two accumulated micro-batches each, Adam, FP8."""
    popxl = pytest.importorskip("popxl")
    config = load_config(None, [
        f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", "model.depth=2",
        "model.hidden_size=16", "model.heads=2", "precision.dtype=fp8",
        "training.batch_size=4", "ipu.gradient_accumulation=2", "ipu.device_iterations=2",
        "backend=popxl"])
    torch.manual_seed(0)
    models = [build_model(config)]
    models.append(copy.deepcopy(models[0]))
    ids, labels = batch(rows=config.samples_per_call)
    losses = []
    for model, xl in zip(models, (popxl, popxl_standin)):
        wrapper = PopXLTrainingModel(model, None, training=config.training,
                                     precision=config.precision, ipu=config.ipu, xl=xl,
                                     device="ipu_model")
        losses.append(wrapper(ids, labels)[1])
        wrapper.copy_weights_to_host()
        wrapper.destroy()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-2, atol=0)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert relative(a, b) < 1e-2, name


def test_the_codelets_custom_op_on_the_ipu_model_matches_the_reference():
    """amax="codelets" with the PopXL binding built by CMake (target ius_popxl_ops)."""
    popxl = pytest.importorskip("popxl")
    from ipu_unit_scaling.backends.popxl import codelets

    try:
        codelets.binding_path()
    except ImportError as error:
        pytest.skip(str(error))
    model, config = tiny_decoder(), FP8Config()
    real = loss_and_gradients(model, *batch(), fp8=config, xl=popxl, device="ipu_model",
                              amax="codelets")
    stand_in = loss_and_gradients(model, *batch(), fp8=config, xl=popxl_standin, amax="codelets")
    assert real.non_finite == 0
    assert real.loss == pytest.approx(stand_in.loss, rel=1e-2)
    for name, grad in stand_in.gradients.items():
        assert relative(real.gradients[name], grad) < 0.15, name

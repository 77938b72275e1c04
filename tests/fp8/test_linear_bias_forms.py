"""Every form of the unit-scaled linear adds its bias times the output scale, as unit-scaling
0.3.5 does: ``output_scale * (x @ weight.T + bias)``.

A layer with a bias and the same layer with a zero bias see the same input and weight, so they
cast them to the same FP8 values and compute the same product; their outputs then differ by
exactly ``output_scale * bias``, up to one float32 rounding of the sum. That holds in every form
(eager GEMM, the composition torch.compile gets, PopTorch's, the FP8 values path as a C++ node
and as a Python Function, the FP8 recipes, and the FP8 layer's PopTorch form), whatever its
casts, so each is checked against it. The bias gradient is the same in every form:
``grad_weight_scale * sum(grad)``.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

import pytest
import torch
from helpers import built_native_layers

import ipu_unit_scaling as uu
import ipu_unit_scaling.functional as U
from ipu_unit_scaling.fp8 import FP8Config
from ipu_unit_scaling.fp8.linear import FP8UnitScaledLinear
from ipu_unit_scaling.ops import fused_ops, native_layers
from ipu_unit_scaling.ops.trace_switch import ipu_tracing
from ipu_unit_scaling.ops.unit_ops import linear_scales

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

ROWS, FAN_IN, FAN_OUT = 40, 64, 24
# float32's unit roundoff: the two layers' GEMMs may add their terms and the bias in other
# orders (a GEMM that accumulates into its bias operand), so each output may round
# differently by up to (terms + a few) unit roundoffs of the sum of the terms' magnitudes.
UNIT_ROUNDOFF = 2.0**-24
# FP8 casts (E4M3, E5M2, E2M1 and their scales) enlarge a value by at most this factor.
CAST_GROWTH = 1.5


def _inputs():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, ROWS // 2, FAN_IN, generator=generator)
    bias = torch.randn(FAN_OUT, generator=generator) * 3
    grad = torch.randn(2, ROWS // 2, FAN_OUT, generator=generator)
    return x, bias, grad


def _assert_bias_times_output_scale(with_bias: torch.Tensor, without: torch.Tensor,
                                    bias: torch.Tensor, output_scale: float,
                                    magnitudes: torch.Tensor, terms: int) -> None:
    """``magnitudes``: the sum of the absolute products of each output's terms, times the
    output scale, in the output's layout."""
    difference = (with_bias - without).reshape(-1, FAN_OUT)
    expected = (output_scale * bias).expand_as(difference)
    bound = (terms + 4) * UNIT_ROUNDOFF * (magnitudes.reshape(-1, FAN_OUT)
                                          + (output_scale * bias).abs())
    assert ((difference - expected).abs() <= bound).all()


def _check_layer(forward: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
                 layer: torch.nn.Module, output_scale: float, grad_bias_scale: float) -> None:
    x, bias, grad = _inputs()
    zero_bias = copy.deepcopy(layer)
    with torch.no_grad():
        layer.bias.copy_(bias)
        zero_bias.bias.zero_()
    y = forward(layer, x)
    y.backward(grad)
    weight = layer.weight.detach().float()
    magnitudes = x.abs() @ weight.abs().t() * output_scale * CAST_GROWTH**2
    _assert_bias_times_output_scale(y.detach(), forward(zero_bias, x).detach(), bias,
                                    output_scale, magnitudes, FAN_IN)
    torch.testing.assert_close(layer.bias.grad.float(), grad.reshape(-1, FAN_OUT).sum(0)
                               * grad_bias_scale, rtol=1e-6, atol=1e-6)


def _call(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _compose(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The ops' composition, as torch.compile and the graph transforms get it.
    compiling = fused_ops._compiling
    fused_ops._compiling = lambda: True
    try:
        return layer(x)
    finally:
        fused_ops._compiling = compiling


def _traced(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with ipu_tracing():
        return layer(x)


@pytest.fixture
def python_functions(monkeypatch) -> Iterator[None]:
    monkeypatch.setattr(native_layers, "module", lambda: None)
    yield


@pytest.mark.parametrize("form", [_call, _compose, _traced],
                         ids=["eager", "composed", "poptorch"])
@pytest.mark.parametrize("constraint", ["to_output_scale", None, "gmean"])
def test_the_linear_adds_its_bias_times_the_output_scale(form, constraint) -> None:
    layer = uu.Linear(FAN_IN, FAN_OUT, bias=True, constraint=constraint)
    output_scale, _, grad_weight_scale = linear_scales(FAN_IN, FAN_OUT, ROWS, constraint)
    _check_layer(form, layer, output_scale, grad_weight_scale)


@pytest.mark.parametrize("form", [_call, _traced], ids=["eager", "poptorch"])
def test_conv1d_adds_its_bias_times_the_output_scale(form) -> None:
    kernel = 3
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 10, generator=generator)
    weight = torch.randn(FAN_OUT, 16, kernel, generator=generator)
    bias = torch.randn(FAN_OUT, generator=generator)
    output_scale = (16 * kernel) ** -0.5  # unconstrained
    with ipu_tracing() if form is _traced else torch.enable_grad():
        with_bias = U.conv1d(x, weight, bias, padding=1, constraint=None)
        without = U.conv1d(x, weight, torch.zeros_like(bias), padding=1, constraint=None)
    magnitudes = torch.nn.functional.conv1d(x.abs(), weight.abs(), padding=1) * output_scale
    _assert_bias_times_output_scale(with_bias.transpose(1, 2), without.transpose(1, 2), bias,
                                    output_scale, magnitudes.transpose(1, 2), 16 * kernel)


@pytest.mark.parametrize("recipe", ["amax", "static", "delayed", "rowwise", "block", "mx"])
@pytest.mark.parametrize("nodes", ["C++ node", "Python Function"])
def test_the_fp8_unit_scaled_linear_adds_its_bias_times_the_output_scale(
        request, recipe, nodes) -> None:
    if nodes == "C++ node":
        built_native_layers()
    else:
        request.getfixturevalue("python_functions")
    layer = FP8UnitScaledLinear.from_unit_scaled(
        uu.Linear(FAN_IN, FAN_OUT, bias=True), FP8Config().with_recipe(recipe))
    output_scale, _, _ = linear_scales(FAN_IN, FAN_OUT, ROWS, layer.constraint)
    _check_layer(_call, layer, output_scale, ROWS**-0.5)


@pytest.mark.parametrize("recipe", ["amax", "block"])
def test_the_fp8_unit_scaled_linears_poptorch_form_adds_its_bias_times_the_output_scale(
        recipe) -> None:
    layer = FP8UnitScaledLinear.from_unit_scaled(
        uu.Linear(FAN_IN, FAN_OUT, bias=True), FP8Config().with_recipe(recipe))
    output_scale, _, _ = linear_scales(FAN_IN, FAN_OUT, ROWS, layer.constraint)
    _check_layer(_traced, layer, output_scale, ROWS**-0.5)


def test_the_fp8_unit_scaled_linear_in_float64_adds_its_bias_times_the_output_scale() -> None:
    # float64 takes the layer's last form: FP8 casts around the plain FP8 linear, scaled after.
    layer = FP8UnitScaledLinear.from_unit_scaled(uu.Linear(FAN_IN, FAN_OUT, bias=True),
                                                 FP8Config()).double()
    output_scale, _, _ = linear_scales(FAN_IN, FAN_OUT, ROWS, layer.constraint)
    _check_layer(lambda m, x: m(x.double()).float(), layer, output_scale, ROWS**-0.5)

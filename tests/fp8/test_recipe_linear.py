"""The FP8 linear layer under each recipe: its three GEMMs against the float GEMMs of operands
quantised by independent references (each along that GEMM's reduction dimension), to float32
GEMM rounding; the delayed recipe's amax history, its state and its checkpoint."""
from __future__ import annotations

from typing import Tuple

import ml_dtypes
import numpy as np
import pytest
import torch
from recipe_references import ML_ELEMENTS, gfloat_mx, gfloat_nvfp4, per_tensor_reference

import ipu_unit_scaling as uu
from ipu_unit_scaling.fp8 import FP8Config, FP8Linear, fp8_linear, fp8_matmul, log2_scale
from ipu_unit_scaling.fp8.linear import FP8UnitScaledLinear
from ipu_unit_scaling.fp8.recipe_linear import HISTORY_ROLES, new_amax_history, recipe_linear
from ipu_unit_scaling.ops.trace_switch import ipu_tracing
from ipu_unit_scaling.ops.unit_ops import linear_scales

pytestmark = pytest.mark.numerics

UNIT_ROUNDOFF = 2.0**-24  # float32
GROUPED = ["rowwise", "block", "block32", "mx", "mx_round_up", "mxfp4", "nvfp4"]


def recipe_config(name: str) -> FP8Config:
    if name == "block32":  # small blocks: several whole ones and a ragged one per operand
        return FP8Config(scaling="block", block_size=32)
    return FP8Config.from_recipe(name)


def tiles(t: torch.Tensor, size: int, fmt, margin: int) -> torch.Tensor:
    out = torch.empty_like(t)
    for c in range(0, t.shape[1], size):
        for r in range(t.shape[0]):
            out[r, c:c + size] = per_tensor_reference(t[r, c:c + size], fmt, margin)
    return out


def squares(t: torch.Tensor, size: int, fmt, margin: int) -> torch.Tensor:
    out = torch.empty_like(t)
    for r in range(0, t.shape[0], size):
        for c in range(0, t.shape[1], size):
            out[r:r + size, c:c + size] = per_tensor_reference(t[r:r + size, c:c + size], fmt,
                                                               margin)
    return out


def round_up_mx(t: torch.Tensor, fmt) -> torch.Tensor:
    """MX with round-up scales, written out: the least 2**e with amax <= max * 2**e, then the
    elements rounded by ml_dtypes."""
    element = getattr(ml_dtypes, ML_ELEMENTS[fmt.name])
    out = torch.empty_like(t)
    for r in range(t.shape[0]):
        for c in range(0, t.shape[1], 32):
            block = t[r, c:c + 32]
            amax = float(block.abs().max())
            e = -127
            if amax > 0:
                e = -126
                while amax > fmt.max * 2.0**e:
                    e += 1
            scaled = (block.double().numpy() * 2.0**-e).astype(np.float32)
            out[r, c:c + 32] = torch.from_numpy(
                scaled.astype(element).astype(np.float64) * 2.0**e)
    return out


def reference_cast(config: FP8Config, name: str, t: torch.Tensor, role: str) -> torch.Tensor:
    """Independent FP8 values of the 2-D operand ``t`` (groups along its last dimension)."""
    fmt, margin = {"input": (config.activation, config.activation_margin),
                   "weight": (config.weight, config.weight_margin),
                   "grad_output": (config.gradient, config.gradient_margin)}[role]
    t = t.contiguous()
    if config.scaling == "rowwise":
        return torch.stack([per_tensor_reference(row, fmt, margin) for row in t])
    if config.scaling == "block":
        size = config.group_size
        return squares(t, size, fmt, margin) if role == "weight" else tiles(t, size, fmt, margin)
    if config.scaling == "nvfp4":
        return torch.from_numpy(gfloat_nvfp4(t))
    if config.scale_rounding == "up":
        return round_up_mx(t, fmt)
    return torch.from_numpy(gfloat_mx(t, fmt.name)).float()


def gemm_bound(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Float32 GEMM rounding against an exact product: gamma_K * sum |a_i b_i|, plus one
    rounding for the scale ``alpha``, with a factor 2 for slack in the bound's derivation."""
    k = a.shape[1]
    gamma = k * UNIT_ROUNDOFF / (1 - k * UNIT_ROUNDOFF)
    return 2 * (gamma + UNIT_ROUNDOFF) * abs(alpha) * (a.double().abs() @ b.double().abs())


def assert_gemm_close(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      alpha: float = 1.0) -> None:
    exact = alpha * (a.double() @ b.double())
    error = (actual.double() - exact).abs()
    bound = gemm_bound(a, b, alpha)
    assert bool((error <= bound).all()), float((error - bound).max())


def operands(seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (2, 20, 160), weight (48, 160), output gradient (2, 20, 48): sizes that leave ragged
    tiles for 128, 32 and 16 along each GEMM's reduction dimension. Columns of magnitudes
    2**0 to 2**-21: a row spans more binades than F143 holds, so what a group's scale keeps
    and flushes depends on the grouping."""
    generator = torch.Generator().manual_seed(seed)
    columns = torch.exp2(-7.0 * (torch.arange(160) % 4))
    x = torch.randn(2, 20, 160, generator=generator) * 3.0 * columns
    weight = torch.randn(48, 160, generator=generator) * 0.05 * columns
    grad = torch.randn(2, 20, 48, generator=generator) * 1e-3
    return x, weight, grad


@pytest.mark.parametrize("name", GROUPED)
def test_each_gemm_casts_along_its_own_reduction_dimension(name):
    config = recipe_config(name)
    x, weight, grad = operands()
    x.requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    y = fp8_linear(x, weight, None, config)
    y.backward(grad)
    x2, w, g2 = x.detach().reshape(-1, 160), weight.detach(), grad.reshape(-1, 48)
    # forward: reduces over K (rows of x and of w)
    xq, wq = reference_cast(config, name, x2, "input"), reference_cast(config, name, w, "weight")
    assert_gemm_close(y.detach().reshape(-1, 48), xq, wq.t())
    # input gradient: reduces over N (rows of dy, columns of w, cast again from w)
    gq = reference_cast(config, name, g2, "grad_output")
    wq_t = reference_cast(config, name, w.t(), "weight")
    assert_gemm_close(x.grad.reshape(-1, 160), gq, wq_t.t())
    # weight gradient: reduces over M (columns of dy and of x)
    gq_t = reference_cast(config, name, g2.t(), "grad_output")
    xq_t = reference_cast(config, name, x2.t(), "input")
    assert_gemm_close(weight.grad, gq_t, xq_t.t())


def test_the_transposed_operand_is_not_the_forward_copy_transposed():
    """Rowwise: the input gradient's weight operand has per-column scales, so its values are
    not those of the forward pass's per-row copy; the layer uses the per-column ones."""
    config = FP8Config.from_recipe("rowwise")
    _, weight, _ = operands()
    forward_copy = reference_cast(config, "rowwise", weight, "weight")
    recast = reference_cast(config, "rowwise", weight.t(), "weight").t()
    assert not torch.equal(forward_copy, recast)


def test_high_precision_weight_gradient():
    config = FP8Config.from_recipe("rowwise_with_gw_hp")
    x, weight, grad = operands(1)
    weight.requires_grad_(True)
    fp8_linear(x, weight, None, config).backward(grad)
    assert_gemm_close(weight.grad, grad.reshape(-1, 48).t(), x.reshape(-1, 160))


@pytest.mark.parametrize("name", ["rowwise", "mx"])
def test_unit_scaled_layer_scales_the_recipe_gemms(name):
    config = FP8Config.from_recipe(name)
    x, weight, grad = operands(2)
    layer = FP8UnitScaledLinear.from_unit_scaled(uu.Linear(160, 48), config)
    with torch.no_grad():
        layer.weight.copy_(weight)
    output_scale, _, _ = linear_scales(160, 48, 40, layer.constraint, layer.scale_power)
    y = layer(x)
    xq = reference_cast(config, name, x.reshape(-1, 160), "input")
    wq = reference_cast(config, name, weight, "weight")
    assert_gemm_close(y.detach().reshape(-1, 48), xq, wq.t(), output_scale)


def delayed_layer(reduction: str = "max", length: int = 3) -> FP8Linear:
    config = FP8Config(scaling="delayed", amax_history_length=length, amax_reduction=reduction)
    layer = FP8Linear(160, 48, bias=False, config=config)
    with torch.no_grad():
        layer.weight.copy_(operands()[1])
    return layer


def test_delayed_scales_come_from_the_previous_amaxes():
    layer = delayed_layer()
    config = layer.config
    assert layer.amax_history.shape == (3, 3) and not layer.amax_history.any()
    history = []
    for step, magnitude in enumerate([1.0, 100.0, 0.01]):
        x = operands(step)[0] * magnitude
        expected_scale = log2_scale(max(history) if history else 0.0, config.activation)
        y = layer(x)
        xq = per_tensor_reference_at(x.reshape(-1, 160), config, expected_scale)
        w_amax = float(layer.weight.detach().abs().max()) if step else 0.0
        w_scale = log2_scale(w_amax, config.weight)
        wq = per_tensor_reference_at(layer.weight.detach(), config, w_scale)
        assert_gemm_close(y.detach().reshape(-1, 48), xq, wq.t())
        history.insert(0, float(x.abs().max()))
        y.sum().backward()
        assert layer.amax_history[HISTORY_ROLES.index("input")].tolist() == pytest.approx(
            (history + [0.0, 0.0])[:3], rel=0, abs=0)
    assert float(layer.amax_history[2, 0]) == 1.0  # the output gradient of a sum


def per_tensor_reference_at(t: torch.Tensor, config: FP8Config, scale: int) -> torch.Tensor:
    from ipu_unit_scaling.fp8 import cast_from_fp8, cast_to_fp8_reference

    return cast_from_fp8(cast_to_fp8_reference(t, config.activation, log2_scale=scale))


def test_most_recent_reduction_and_evaluation_leaves_history_alone():
    layer = delayed_layer("most_recent", length=2)
    x = operands()[0]
    layer(x * 1000.0)
    layer(x)
    assert float(layer.amax_history[0, 0]) == float(x.abs().max())
    from ipu_unit_scaling.fp8.recipe_linear import delayed_log2_scale

    assert delayed_log2_scale(layer.amax_history, layer.config, "input") == log2_scale(
        float(x.abs().max()), "F143")
    before = layer.amax_history.clone()
    layer.eval()
    layer(x * 5.0)
    with torch.no_grad():
        layer.train()(x * 5.0)
    assert torch.equal(layer.amax_history, before)


def test_delayed_history_is_in_the_state_dict_and_resumes_exactly():
    layer = delayed_layer()
    for step in range(4):
        layer(operands(step)[0]).square().sum().backward()
    state = layer.state_dict()
    assert torch.equal(state["amax_history"], layer.amax_history)
    copy = delayed_layer()
    copy.load_state_dict(state)
    x = operands(9)[0]
    assert torch.equal(copy(x), layer(x))
    assert torch.equal(copy.amax_history, layer.amax_history)


def test_delayed_needs_its_state_and_refuses_a_non_finite_amax():
    config = FP8Config(scaling="delayed")
    x, weight, _ = operands()
    with pytest.raises(ValueError, match="amax history"):
        fp8_linear(x, weight, None, config)
    history = new_amax_history(config)
    x[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="nan"):
        recipe_linear(x, weight, None, config, amax_history=history, update_history=True)
    assert not history.any()


@pytest.mark.parametrize("name,error", [("delayed", "no PopTorch form"),
                                        ("nvfp4", "no PopTorch form"), ("mxfp4", "E2M1")])
def test_recipes_without_an_ipu_form_say_so(name, error):
    # (rowwise, block and mx have one: tests/fp8/test_group_cast_ops.py)
    config = FP8Config.from_recipe(name)
    x, weight, _ = operands()
    with ipu_tracing(), pytest.raises(ValueError, match=error):
        fp8_linear(x, weight, None, config)


@pytest.mark.parametrize("name", ["delayed", "rowwise", "mx"])
def test_fp8_matmul_casts_per_tensor_only(name):
    x, weight, _ = operands()
    with pytest.raises(ValueError, match="per tensor"):
        fp8_matmul(x, weight.t(), FP8Config.from_recipe(name))


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fnuz"),
                    reason="needs torch._scaled_mm and torch's float8 dtypes")
@pytest.mark.parametrize("formats", [("F143", "F143", "F152"), ("E4M3FN", "E4M3FN", "E5M2")])
def test_rowwise_scaled_mm_gives_the_simulation_to_float32_sum_order(formats):
    """The products of FP8 values with power-of-two scales are exact in float32: the float8
    GEMMs and the simulated ones differ only in the order of their float32 sums."""
    config = FP8Config(scaling="rowwise", activation_format=formats[0],
                       weight_format=formats[1], gradient_format=formats[2])
    x, weight, grad = operands(3)
    results = []
    for use_scaled_mm in (False, True):
        xi, wi = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        try:
            y = fp8_linear(xi, wi, None, config, use_scaled_mm=use_scaled_mm)
        except RuntimeError as error:  # a torch whose CPU _scaled_mm refuses these dtypes
            pytest.skip(f"torch._scaled_mm does not run here: {error}")
        y.backward(grad)
        results.append((y.detach().reshape(-1, 48), xi.grad.reshape(-1, 160), wi.grad))
    x2, g2 = x.reshape(-1, 160), grad.reshape(-1, 48)
    xq, wq = (reference_cast(config, "rowwise", t, role)
              for t, role in ((x2, "input"), (weight, "weight")))
    gq, wq_t = (reference_cast(config, "rowwise", t, role)
                for t, role in ((g2, "grad_output"), (weight.t(), "weight")))
    gq_t, xq_t = (reference_cast(config, "rowwise", t, role)
                  for t, role in ((g2.t(), "grad_output"), (x2.t(), "input")))
    for (y, grad_x, grad_w) in results:
        assert_gemm_close(y, xq, wq.t())
        assert_gemm_close(grad_x, gq, wq_t.t())
        assert_gemm_close(grad_w, gq_t, xq_t.t())
    assert not torch.equal(results[0][0], torch.zeros_like(results[0][0]))


def test_scaled_mm_is_refused_for_block_recipes():
    x, weight, _ = operands()
    with pytest.raises(ValueError, match="rowwise"):
        fp8_linear(x, weight, None, FP8Config.from_recipe("mx"), use_scaled_mm=True)


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("role", HISTORY_ROLES)
def test_grouped_operand_values_are_the_casts_of_the_layer(name, role):
    """`grouped_operand_values` (what a GPT layer's two-Function form casts with, by the host
    kernel's values-only path where it applies) gives the layer's casts bit for bit: along
    the rows, and along the columns in the operand's shape; a block with an infinity leaves
    the fast path and is refused as the layer refuses it."""
    from ipu_unit_scaling.fp8 import host_library
    from ipu_unit_scaling.fp8.recipe_linear import _casts, grouped_operand_values
    from ipu_unit_scaling.fp8.scaling import NonFiniteAmaxError

    config = recipe_config(name)
    generator = torch.Generator().manual_seed(5)
    t = torch.randn(70, 45, generator=generator) * torch.exp2(
        torch.randint(-6, 6, (70, 1), generator=generator).float())
    rows, columns = grouped_operand_values(t, config, role, "site", True)
    assert columns is not None
    with host_library.disabled():
        want_rows, want_columns = _casts(t, config, role, "site", None, True)
    assert want_rows is not None and want_columns is not None
    assert torch.equal(rows.view(torch.int32), want_rows.values.view(torch.int32))
    if name.startswith("block") and role == "weight":  # square blocks: the one cast
        assert columns is rows
    else:
        assert torch.equal(columns.view(torch.int32),
                           want_columns.values.t().contiguous().view(torch.int32))
    assert grouped_operand_values(t, config, role, "site", False)[1] is None
    t[3, 7] = float("inf")
    with pytest.raises((NonFiniteAmaxError, ValueError)):
        grouped_operand_values(t, config, role, "site", True)

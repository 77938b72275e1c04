"""The grouped FP8 casts as graph ops (``fp8_group_quantise`` and
``fp8_group_quantise_gradient``), and the rowwise, block and MX recipes' FP8 linear traced from
them through the PopTorch stand-in, as the IPU backend traces it: the trace calls the PopART
ops through ``poptorch.custom_op``, the output is the eager layer's, and a training step's
gradients are the eager layer's, to float32 GEMM rounding."""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
import torch
from helpers import train_in_process
from torch import nn

import ipu_unit_scaling as uu
from ipu_unit_scaling.backends.poptorch.fp8_custom_op import PopTorchFP8CustomOps
from ipu_unit_scaling.backends.poptorch_backend import STANDIN_MODULE, poptorch_module
from ipu_unit_scaling.fp8 import FP8Config, FP8Linear, get_format
from ipu_unit_scaling.fp8.group_cast import Grouping, group_cast
from ipu_unit_scaling.fp8.group_cast_ops import (
    group_quantise_attributes,
    grouped_quantise,
    grouped_quantise_gradient,
)
from ipu_unit_scaling.fp8.linear import FP8UnitScaledLinear
from ipu_unit_scaling.ipu import check_poptorch
from ipu_unit_scaling.ops.trace_switch import ipu_tracing
from ipu_unit_scaling.ops.unit_ops import linear_scales
from ipu_unit_scaling.training.run_records import read_metrics

UNIT_ROUNDOFF = 2.0**-24  # float32
CASTS = [  # (format, grouping, rule, scale_rounding, margin, saturate)
    ("F143", Grouping("row"), "amax", "floor", 0, True),
    ("F152", Grouping("tile", 32), "amax", "floor", 3, False),
    ("F143", Grouping("block", 16), "amax", "floor", 1, True),
    ("E4M3FN", Grouping("tile", 32), "mx", "floor", 0, True),
    ("E5M2", Grouping("tile", 32), "mx", "up", 0, True),
]


def spread(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values times 2**-12 .. 2**12 by column: groups whose scales differ."""
    generator = torch.Generator().manual_seed(seed)
    columns = torch.exp2(torch.randint(-12, 13, (cols,), generator=generator).float())
    return torch.randn(rows, cols, generator=generator) * columns


def reference(x: torch.Tensor, cast: Tuple) -> torch.Tensor:
    fmt, grouping, rule, rounding, margin, saturate = cast
    return group_cast(x, get_format(fmt), grouping, rule=rule, margin=margin,
                      overflow="saturate" if saturate else "nan",
                      scale_rounding=rounding).values


# ------------------------------------------------------------------------------ the two ops


@pytest.mark.numerics
@pytest.mark.parametrize("cast", CASTS, ids=lambda c: f"{c[0]}-{c[1].kind}-{c[2]}")
def test_group_quantise_is_the_grouped_cast_with_a_straight_through_gradient(cast):
    fmt, grouping, rule, rounding, margin, saturate = cast
    x = spread(40, 70, 1).requires_grad_()
    y = grouped_quantise(x, fmt, grouping, rule, margin, saturate, rounding)
    expected = reference(x.detach(), cast)
    assert torch.equal(y.detach() + 0.0, expected + 0.0)  # (+0.0: OCP's -0 is the IPU's +0)
    assert not torch.equal(expected, x.detach())  # the cast did round
    dy = spread(40, 70, 2)
    y.backward(dy)
    assert torch.equal(x.grad, dy)


@pytest.mark.numerics
@pytest.mark.parametrize("cast", CASTS, ids=lambda c: f"{c[0]}-{c[1].kind}-{c[2]}")
def test_the_gradient_op_is_the_identity_and_casts_its_gradient(cast):
    fmt, grouping, rule, rounding, margin, saturate = cast
    x = spread(40, 70, 3).requires_grad_()
    y = grouped_quantise_gradient(x, fmt, grouping, rule, margin, saturate, rounding)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    dy = spread(40, 70, 4)
    y.backward(dy)
    assert torch.equal(x.grad + 0.0, reference(dy, cast) + 0.0)
    assert not torch.equal(x.grad, dy)


def test_the_grouped_ops_check_their_arguments():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="E2M1"):
        grouped_quantise(x, "E2M1", Grouping("tile", 32), "mx")
    with pytest.raises(ValueError, match="rule"):
        grouped_quantise(x, "F143", Grouping("tile", 32), "nvfp4")
    with pytest.raises(ValueError, match="saturate"):
        grouped_quantise_gradient(x, "E4M3FN", Grouping("tile", 32), "mx", saturate=False)
    with pytest.raises(ValueError, match="per-tensor"):
        grouped_quantise(x, "F143", Grouping("tensor"))
    with pytest.raises(TypeError, match="2-D"):
        grouped_quantise(torch.randn(2, 8, 64), "F143", Grouping("row"))
    with pytest.raises(ValueError, match="F999"):  # the op checks too, for direct callers
        torch.ops.ipu_unit_scaling.fp8_group_quantise_gradient(x, "F999", "row", 0, "amax",
                                                                "floor", 0, True)


class RecordingOps:
    """A custom-op implementation with the grouped ops, recording their calls."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []

    def quantise(self, x, fmt_name, margin, saturate, log2_scale):
        return x

    def quantise_gradient(self, x, fmt_name, margin, saturate, log2_scale=None):
        return x

    def group_quantise(self, x, *attributes):
        self.calls.append(("group_quantise",) + attributes)
        return x + 1

    def group_quantise_gradient(self, x, *attributes):
        self.calls.append(("group_quantise_gradient",) + attributes)
        return x + 2


class PerTensorOnly:
    def quantise(self, x, fmt_name, margin, saturate, log2_scale):
        return x

    def quantise_gradient(self, x, fmt_name, margin, saturate, log2_scale=None):
        return x


def test_ipu_tracing_gives_the_grouped_casts_to_an_implementation_that_has_them():
    x = torch.zeros(4, 64)
    recorder = RecordingOps()
    with ipu_tracing(custom_ops=recorder):
        assert torch.equal(grouped_quantise(x, "E4M3FN", Grouping("tile", 32), "mx",
                                            scale_rounding="up"), x + 1)
        # The amax rule has one scale rounding, which the ops call "floor".
        assert torch.equal(grouped_quantise_gradient(x, "F152", Grouping("row"), "amax", 3,
                                                     scale_rounding="up"), x + 2)
    assert recorder.calls == [("group_quantise", "E4M3FN", "tile", 32, "mx", "up", 0, True),
                              ("group_quantise_gradient", "F152", "row", 0, "amax", "floor", 3,
                               True)]
    x = spread(4, 64, 5)
    with ipu_tracing(custom_ops=PerTensorOnly()):  # without them: the torch.library ops
        values = grouped_quantise(x, "F143", Grouping("row"))
    assert torch.equal(values, reference(x, ("F143", Grouping("row"), "amax", "floor", 0, True)))


# ------------------------------------------------- the FP8 linear traced through the stand-in

STANDIN = poptorch_module("emulator")
RECIPES = {
    "block": FP8Config(scaling="block"),
    "block32": FP8Config(scaling="block", block_size=32),  # whole and ragged blocks
    "mx": FP8Config.from_recipe("mx"),
    "rowwise": FP8Config.from_recipe("rowwise"),
    "rowwise_with_gw_hp": FP8Config.from_recipe("rowwise_with_gw_hp"),
}
# The PopART ops each trace calls: (op, grouping, group_size) of every custom op call.
FORWARD_CASTS = {
    "block": {("Fp8GroupQuantise", "block", 128), ("Fp8GroupQuantise", "tile", 128)},
    "block32": {("Fp8GroupQuantise", "block", 32), ("Fp8GroupQuantise", "tile", 32)},
    "mx": {("Fp8GroupQuantise", "tile", 32)},
    "rowwise": {("Fp8GroupQuantise", "row", 0)},
    "rowwise_with_gw_hp": {("Fp8GroupQuantise", "row", 0)},
}
SHAPES = (2, 37, 80), (50, 80)  # x and the weight: ragged groups of 32 and 128 along K, N, M


def operands(seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, weight, bias and an output gradient, each spanning more binades than FP8 holds."""
    (batch, rows, k), (n, _) = SHAPES
    x = spread(batch * rows, k, seed).reshape(batch, rows, k) * 2.0**-4
    weight = spread(n, k, seed + 1) * 2.0**-8
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2))
    dy = spread(batch * rows, n, seed + 3).reshape(batch, rows, n)
    return x, weight, bias, dy


def gemm_rounding(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A bound on what float32 summation order changes in ``a @ b`` of FP8 values cast from
    these operands: ``k`` roundings of the partial sums, each at most ``2**-24`` of the sum
    of the magnitudes, which the casts grow by less than 2x (one FP8 step up, or the
    saturation of a group's largest element)."""
    return 4 * a.shape[-1] * UNIT_ROUNDOFF * (a.abs() @ b.abs()) + 1e-30


def _custom_ops() -> PopTorchFP8CustomOps:
    """The IPU backend's custom ops on the stand-in (which needs no PopART library)."""
    return PopTorchFP8CustomOps(poptorch=STANDIN_MODULE, needs_library=False)


class Inference(nn.Module):
    """Without gradients (no_grad): the traced layer holds the forward product alone."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer, self.ops = layer, _custom_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with ipu_tracing(self.ops), torch.no_grad():
            return self.layer(x)


class Training(nn.Module):
    """The input is a parameter too: one SGD step with lr 1 takes both gradients from the
    parameters. The loss is ``sum(y * dy)``, so the output gradient is ``dy`` exactly."""

    def __init__(self, layer: nn.Module, x: torch.Tensor):
        super().__init__()
        self.layer, self.ops = layer, _custom_ops()
        self.x = nn.Parameter(x.clone())

    def forward(self, dy: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        with ipu_tracing(self.ops):
            y = self.layer(self.x)
        return y, STANDIN.identity_loss((y * dy).sum(), reduction="none")


def _layer(config: FP8Config, weight: torch.Tensor, bias: torch.Tensor,
           unit_scaled: bool = False) -> nn.Module:
    n, k = weight.shape
    layer = (FP8UnitScaledLinear.from_unit_scaled(uu.Linear(k, n, bias=True), config)
             if unit_scaled else FP8Linear(k, n, config=config))
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    return layer


def _calls(standin_calls: list) -> Dict[str, set]:
    """The custom ops called: for the grouped ones, (op, grouping, group size) of each call."""
    found: Dict[str, set] = {}
    for name, domain, version, attributes in standin_calls:
        assert (domain, version) == ("ai.graphcore.unit_scaling", 1)
        grouped = name.startswith("Fp8Group")
        found.setdefault(name, set()).add(
            (name, attributes["grouping"], attributes["group_size"]) if grouped else name)
    return found


@pytest.mark.numerics
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_traced_forward_calls_the_grouped_op_and_gives_the_eager_output(recipe,
                                                                           standin_calls):
    config = RECIPES[recipe]
    x, weight, bias, _ = operands(10)
    layer = _layer(config, weight, bias)
    with torch.no_grad():
        eager = layer(x)
    traced = STANDIN.inferenceModel(Inference(layer))(x)
    calls = _calls(standin_calls)
    assert set(calls) == {"Fp8GroupQuantise"}  # no gradient ops without gradients
    assert calls["Fp8GroupQuantise"] == FORWARD_CASTS[recipe]
    assert traced.shape == eager.shape
    bound = gemm_rounding(x, weight.t()) + UNIT_ROUNDOFF * eager.abs()
    assert bool(((traced - eager).abs() <= bound).all())
    # The bound is far below what the casts change: the test would see them missing.
    unquantised = torch.nn.functional.linear(x, weight, bias)
    assert bool(((unquantised - eager).abs() > 100 * bound).any())


def _eager_gradients(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    layer(x).backward(dy)
    grads = (x.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
    layer.zero_grad(set_to_none=True)
    return grads


def _close(after: torch.Tensor, before: torch.Tensor, eager_grad: torch.Tensor,
           bound: torch.Tensor) -> bool:
    """``after`` is one lr-1 step from ``before`` with a gradient within ``bound`` of
    ``eager_grad`` (plus the roundings of the two subtractions)."""
    expected = before - eager_grad
    room = bound + 2 * UNIT_ROUNDOFF * (expected.abs() + before.abs())
    return bool(((after - expected).abs() <= room).all())


# The grouping of the output gradient's cast (Fp8GroupGradientQuantise) under each recipe.
GRADIENT_CASTS = {"block": ("tile", 128), "block32": ("tile", 32), "mx": ("tile", 32),
                  "rowwise": ("row", 0), "rowwise_with_gw_hp": ("row", 0)}


@pytest.mark.numerics
@pytest.mark.parametrize("unit_scaled", [False, True], ids=["plain", "unit-scaled"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_traced_training_step_gives_the_eager_gradients(recipe, unit_scaled, standin_calls):
    config = RECIPES[recipe]
    x, weight, bias, dy = operands(20)
    layer = _layer(config, weight, bias, unit_scaled)
    grad_x, grad_w, grad_b = _eager_gradients(layer, x, dy)
    model = Training(layer, x)
    optimizer = STANDIN.optim.SGD(model.parameters(), lr=1.0)
    training = STANDIN.trainingModel(model, optimizer=optimizer)
    training(dy)
    training.copyWeightsToHost()
    calls = _calls(standin_calls)
    assert calls["Fp8GroupQuantise"] == FORWARD_CASTS[recipe]
    assert calls["Fp8GroupGradientQuantise"] == {("Fp8GroupGradientQuantise",
                                                  *GRADIENT_CASTS[recipe])}
    assert set(calls) == {"Fp8GroupQuantise", "Fp8GroupGradientQuantise"} | (
        {"ScaledIdentity"} if unit_scaled else set())
    new_x, new_w, new_b = (t.detach() for t in (model.x, layer.weight, layer.bias))
    for before, after in ((x, new_x), (weight, new_w), (bias, new_b)):
        assert bool(torch.isfinite(after).all()) and not torch.equal(after, before)
    rows = x.numel() // x.shape[-1]
    scales = (1.0, 1.0, 1.0)
    if unit_scaled:
        _, grad_input_scale, grad_weight_scale = linear_scales(
            weight.shape[1], weight.shape[0], rows, layer.constraint, layer.scale_power)
        scales = (grad_input_scale, grad_weight_scale, rows**-0.5)
    dy2, x2 = dy.reshape(rows, -1), x.reshape(rows, -1)
    dx_bound = scales[0] * gemm_rounding(dy, weight)
    assert _close(new_x, x, grad_x, dx_bound)
    assert _close(new_w, weight, grad_w, scales[1] * gemm_rounding(dy2.t(), x2))
    assert _close(new_b, bias, grad_b, scales[2] * rows * UNIT_ROUNDOFF * dy2.abs().sum(0))
    # The casts change the gradients far beyond that bound: the test sees them.
    assert bool(((scales[0] * (dy @ weight) - grad_x).abs() > 100 * dx_bound).any())


# What docs/guide/ipu.md counts in a traced layer whose input and weight take gradients:
# (Fp8GroupQuantise, Fp8GroupGradientQuantise, forward matmuls); without gradients, (2, 0, 1).
PROGRAMS = {"block": (3, 2, 2), "block32": (3, 2, 2), "mx": (4, 2, 3), "rowwise": (4, 2, 3),
            "rowwise_with_gw_hp": (3, 1, 3)}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_the_traced_program_holds_the_ops_the_guide_counts(recipe):
    x, weight, bias, dy = operands(30)
    layer = _layer(RECIPES[recipe], weight, bias)

    def counts(model: nn.Module, *inputs: torch.Tensor) -> Tuple[int, int, int]:
        ops = check_poptorch(model, *inputs).op_counts
        return (ops.get("ipu_unit_scaling::fp8_group_quantise", 0),
                ops.get("ipu_unit_scaling::fp8_group_quantise_gradient", 0),
                ops.get("aten::mm", 0))

    assert counts(Training(layer, x), dy) == PROGRAMS[recipe]
    assert counts(Inference(layer), x) == (2, 0, 1)


def test_the_attributes_are_the_cpp_ops():
    assert group_quantise_attributes("E4M3FN", "tile", 32, "mx", "up", 0, True) == {
        "format": "E4M3FN", "grouping": "tile", "group_size": 32, "rule": "mx",
        "scale_rounding": "up", "margin": 0, "saturate": 1}


# ------------------------------------------------------------ a GPT on the emulator backend


@pytest.mark.usefixtures("ops_as_torch_defines_them", "one_thread")
@pytest.mark.parametrize("scaling", ["block", "mx"])
def test_the_emulator_backend_trains_a_gpt_in_a_grouped_recipe(scaling, data, tmp_path):
    """The tiny config's GPT: the losses follow the CPU backend's. Here they were equal; the
    two backends' casts see tensors that differ by float32 summation order, which can tip an
    FP8 rounding and training carries it (under MX on a corpus four times this one, a
    third-step loss differed by 0.15%), so 1% is allowed."""
    losses = {}
    for backend in ("cpu", "emulator"):
        run_dir = train_in_process(data, tmp_path / backend, [
            f"backend={backend}", "precision.dtype=fp8", f"precision.fp8.scaling={scaling}",
            "training.steps=3"])
        losses[backend] = [float(row["train_loss"]) for row in read_metrics(run_dir)]
    assert len(losses["emulator"]) == 3
    assert all(math.isfinite(loss) for loss in losses["emulator"])
    for cpu, emulator in zip(losses["cpu"], losses["emulator"]):
        assert abs(emulator - cpu) <= 1e-2 * cpu

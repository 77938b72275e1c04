"""The codelets compiled with popc and the PopART custom ops on IPUModel (needs the Poplar SDK)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import ROOT as REPO
from helpers import wide_range_input

poptorch = pytest.importorskip("poptorch", reason="poptorch (Poplar SDK) is not installed")

from ipu_unit_scaling.backends.poptorch.fp8_custom_op import (  # noqa: E402
    PopTorchFP8CustomOps,
    custom_op_library_path,
    fp8_amax_cast,
    load_custom_op_library,
)
from ipu_unit_scaling.fp8 import (  # noqa: E402
    F143,
    F152,
    cast_to_fp8_reference,
    fp8_quantise,
    fp8_quantise_gradient,
)
from ipu_unit_scaling.ops.trace_switch import ipu_tracing  # noqa: E402
from ipu_unit_scaling.scale import scale  # noqa: E402

pytestmark = pytest.mark.ipu
CODELETS = REPO / "codelets"


@pytest.fixture(scope="module")
def codelets_gp(tmp_path_factory) -> Path:
    popc = shutil.which("popc")
    if popc is None:
        pytest.skip("popc is not on PATH (enable the Poplar SDK)")
    out = tmp_path_factory.mktemp("codelets") / "fp8_codelets.gp"
    # Every target this popc knows, as custom_ops/CMakeLists.txt names them.
    targets = subprocess.run([popc, "--list-targets"], check=True, capture_output=True,
                             text=True).stdout.strip()
    subprocess.run([popc, "-O3", "--target", targets, "-I", str(CODELETS),
                    str(CODELETS / "fp8_codelets.cpp"), "-o", str(out)], check=True)
    return out


@pytest.fixture(scope="module")
def custom_op_library(tmp_path_factory) -> Path:
    built = custom_op_library_path()
    if not built.exists():
        cmake = shutil.which("cmake")
        if cmake is None:
            pytest.skip(f"{built} is not built and cmake is not on PATH")
        build = tmp_path_factory.mktemp("custom_ops_build")
        subprocess.run([cmake, "-S", str(REPO / "custom_ops"), "-B", str(build)], check=True)
        subprocess.run([cmake, "--build", str(build)], check=True)
        built = build / "libfp8_custom_ops.so"
    load_custom_op_library(built)
    return built


class AmaxCast(torch.nn.Module):
    def __init__(self, fmt, overflow="saturate", log2_scale=None):
        super().__init__()
        self.fmt, self.overflow, self.log2_scale = fmt, overflow, log2_scale

    def forward(self, x):
        return tuple(fp8_amax_cast(x, self.fmt, overflow=self.overflow,
                                   log2_scale=self.log2_scale))


def run_on_ipu_model(module: torch.nn.Module, x: torch.Tensor):
    options = poptorch.Options()
    options.useIpuModel(True)
    return poptorch.inferenceModel(module, options)(x)


def test_popc_compiles_the_codelets(codelets_gp):
    assert codelets_gp.stat().st_size > 0


@pytest.mark.parametrize("fmt", [F143, F152], ids=str)
@pytest.mark.parametrize("overflow", ["saturate", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_custom_op_matches_the_reference(custom_op_library, fmt, overflow, dtype):
    x = wide_range_input(1472 * 6 + 5, dtype)
    codes, scale, non_finite = run_on_ipu_model(AmaxCast(fmt, overflow), x)
    expected = cast_to_fp8_reference(x, fmt, overflow=overflow)
    assert int(non_finite) == 0
    assert int(scale) == expected.log2_scale
    assert torch.equal(codes.to(torch.uint8), expected.codes)


def test_custom_op_with_a_given_scale_overflows_by_policy(custom_op_library):
    x = torch.tensor([1.0, 300.0, -1000.0, 2.0**-12] * 8)
    for overflow in ("saturate", "nan"):
        codes, scale, _ = run_on_ipu_model(AmaxCast(F143, overflow, log2_scale=2), x)
        expected = cast_to_fp8_reference(x, F143, log2_scale=2, overflow=overflow)
        assert int(scale) == 2
        assert torch.equal(codes.to(torch.uint8), expected.codes)


def test_custom_op_flags_a_non_finite_amax(custom_op_library):
    x = torch.randn(5000)
    x[17] = float("inf")
    _, scale, non_finite = run_on_ipu_model(AmaxCast(F152), x)
    assert int(non_finite) == 1 and int(scale) == 0


class Quantise(torch.nn.Module):
    def __init__(self, library: Path, fmt: str, margin: int, saturate: bool, log2_scale=None):
        super().__init__()
        self.ops = PopTorchFP8CustomOps(library)
        self.args = (fmt, margin, saturate, log2_scale)

    def forward(self, x):
        with ipu_tracing(custom_ops=self.ops):
            return fp8_quantise(x, *self.args)


@pytest.mark.parametrize("fmt,margin,saturate", [("F143", 0, True), ("F152", 3, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("log2_scale", [None, -2])
def test_quantise_op_matches_the_torch_library_op(custom_op_library, fmt, margin, saturate,
                                                  dtype, log2_scale):
    x = wide_range_input(1472 * 6 + 5, dtype)
    out = run_on_ipu_model(Quantise(custom_op_library, fmt, margin, saturate, log2_scale), x)
    expected = torch.ops.ipu_unit_scaling.fp8_quantise(x, fmt, margin, saturate, log2_scale)
    assert out.dtype == dtype
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~expected.isnan()], expected[~expected.isnan()])


class GradientProbe(torch.nn.Module):
    """A zero parameter added to the input: one SGD step with lr 1 leaves ``-dloss/dx`` in it."""

    def __init__(self, library: Path, size: int, gradient_op: bool):
        super().__init__()
        self.ops = PopTorchFP8CustomOps(library)
        self.w = torch.nn.Parameter(torch.zeros(size))
        self.gradient_op = gradient_op

    def forward(self, x, dy):
        with ipu_tracing(custom_ops=self.ops):
            if self.gradient_op:
                y = fp8_quantise_gradient(x + self.w, "F152", margin=3)
            else:
                y = fp8_quantise(x + self.w, "F143")
        return poptorch.identity_loss((y * dy).sum(), reduction="sum")


@pytest.mark.parametrize("gradient_op", [False, True], ids=["quantise", "gradient_quantise"])
def test_grad_ops_give_the_defined_gradients(custom_op_library, gradient_op):
    size = 4096
    x = wide_range_input(size, torch.float32)
    dy = wide_range_input(size + 1, torch.float32)[:size] * 1e-3
    model = GradientProbe(custom_op_library, size, gradient_op)
    options = poptorch.Options()
    options.useIpuModel(True)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=1.0)
    training = poptorch.trainingModel(model, options, optimizer=optimizer)
    training(x, dy)
    training.copyWeightsToHost()
    expected = (torch.ops.ipu_unit_scaling.fp8_quantise(dy, "F152", 3, True, None)
                if gradient_op else dy)
    assert torch.equal(-model.w.detach(), expected)


def normal_range_input(size: int, dtype: torch.dtype) -> torch.Tensor:
    """Magnitudes in [2**-9, 2**9]: times the scales below, normal numbers in float16 too."""
    generator = torch.Generator().manual_seed(size)
    exponents = torch.rand(size, generator=generator) * 18.0 - 9.0
    signs = torch.randint(0, 2, (size,), generator=generator) * 2 - 1
    return (signs * torch.exp2(exponents)).to(dtype)


class ScaledIdentity(torch.nn.Module):
    def __init__(self, library: Path, fwd_scale: float, bwd_scale: float, keep_input: bool):
        super().__init__()
        self.ops = PopTorchFP8CustomOps(library)
        self.scales = (fwd_scale, bwd_scale)
        self.keep_input = keep_input

    def forward(self, x):
        with ipu_tracing(custom_ops=self.ops):
            y = scale(x, *self.scales)
        # Reading x after the op keeps PopART from running it in place.
        return (y, x * 2.0) if self.keep_input else y


@pytest.mark.parametrize("keep_input", [False, True], ids=["inplace", "outplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("fwd_scale", [0.0625, 1 / 3**0.5])
def test_scaled_identity_matches_the_torch_library_op(custom_op_library, keep_input, dtype,
                                                      fwd_scale):
    x = normal_range_input(1472 * 6 + 5, dtype)
    out = run_on_ipu_model(ScaledIdentity(custom_op_library, fwd_scale, 4.0, keep_input), x)
    y = out[0] if keep_input else out
    assert y.dtype == dtype
    assert torch.equal(y, torch.ops.ipu_unit_scaling.scaled_identity(x, fwd_scale, 4.0))
    if keep_input:
        assert torch.equal(out[1], x * 2.0)


class ScaleGradientProbe(torch.nn.Module):
    """As GradientProbe: ``-dloss/dx`` is left in ``w`` by one SGD step with lr 1."""

    def __init__(self, library: Path, size: int, fwd_scale: float, bwd_scale: float):
        super().__init__()
        self.ops = PopTorchFP8CustomOps(library)
        self.w = torch.nn.Parameter(torch.zeros(size))
        self.scales = (fwd_scale, bwd_scale)

    def forward(self, x, dy):
        with ipu_tracing(custom_ops=self.ops):
            y = scale(x + self.w, *self.scales)
        return poptorch.identity_loss((y * dy).sum(), reduction="sum")


# A forward scale of 1 must not let PopART replace the op by the identity: the gradient is
# still scaled.
@pytest.mark.parametrize("fwd_scale", [1.0, 0.5])
def test_scaled_identity_grad_op_scales_the_gradient(custom_op_library, fwd_scale):
    size = 4096
    x = normal_range_input(size, torch.float32)
    dy = normal_range_input(size + 1, torch.float32)[:size]
    bwd_scale = 1 / 7**0.5
    model = ScaleGradientProbe(custom_op_library, size, fwd_scale, bwd_scale)
    options = poptorch.Options()
    options.useIpuModel(True)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=1.0)
    training = poptorch.trainingModel(model, options, optimizer=optimizer)
    training(x, dy)
    training.copyWeightsToHost()
    assert torch.equal(-model.w.detach(), dy * bwd_scale)

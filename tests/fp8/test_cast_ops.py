"""The FP8 custom ops as torch.library ops: numerics, gradients and tracing.

The oracle is independent of the package: the scale from an exact rational floor(log2), the
cast by ml_dtypes' fnuz dtypes (F143 == float8_e4m3fnuz, F152 == float8_e5m2fnuz), numpy's
float32 -> float16 rounding for half inputs.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import List, Optional

import numpy as np
import pytest
import torch
from helpers import ROOT as REPO
from helpers import require_host_library
from torch.fx.experimental.proxy_tensor import make_fx

from ipu_unit_scaling.backends.poptorch import fp8_custom_op as custom_op
from ipu_unit_scaling.backends.poptorch_backend import STANDIN_MODULE
from ipu_unit_scaling.backends.popxl import codelets as popxl_codelets
from ipu_unit_scaling.fp8 import F143, F152, fp8_quantise, fp8_quantise_gradient
from ipu_unit_scaling.fp8 import cast_ops as ops
from ipu_unit_scaling.fp8 import codelet_blocks as blocks
from ipu_unit_scaling.fp8 import codelets_on_host as on_host
from ipu_unit_scaling.fp8 import host_library as _host
from ipu_unit_scaling.fp8.group_cast_ops import (
    GROUP_GRADIENT_QUANTISE_OP,
    group_quantise_attributes,
)
from ipu_unit_scaling.ops.trace_switch import ipu_tracing

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

ml_dtypes = pytest.importorskip("ml_dtypes")
if not all(hasattr(ml_dtypes, name) for name in ("float8_e4m3fnuz", "float8_e5m2fnuz")):
    pytest.skip("this ml_dtypes has no fnuz float8 dtypes", allow_module_level=True)

ML_DTYPES = {"F143": ml_dtypes.float8_e4m3fnuz, "F152": ml_dtypes.float8_e5m2fnuz}
FORMAT_MAX = {"F143": 240.0, "F152": 57344.0}
def oracle_scale(amax: float, fmt_name: str, margin: int) -> int:
    if not math.isfinite(amax) or amax == 0:
        return 0
    ratio = Fraction(FORMAT_MAX[fmt_name]) / Fraction(amax)
    exponent = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    while Fraction(2) ** exponent > ratio:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= ratio:
        exponent += 1
    return max(-31, min(31, exponent - margin))


def oracle(x: torch.Tensor, fmt_name: str, margin: int = 0, saturate: bool = True,
           log2_scale: Optional[int] = None) -> torch.Tensor:
    x32 = x.detach().to(torch.float32).numpy()
    if log2_scale is None:
        amax = float(np.max(np.abs(x32))) if x32.size else 0.0  # NaN propagates
        log2_scale = oracle_scale(amax, fmt_name, margin)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = x32 * np.float32(2.0**log2_scale)
        if saturate:
            limit = FORMAT_MAX[fmt_name]
            scaled = np.where(np.isnan(scaled), scaled, np.clip(scaled, -limit, limit))
        rounded = scaled.astype(np.float32).astype(ML_DTYPES[fmt_name]).astype(np.float64)
        values = (rounded * 2.0**-log2_scale).astype(np.float32)
        if x.dtype == torch.float16:
            values = values.astype(np.float16)
    return torch.from_numpy(np.ascontiguousarray(values))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    integer = torch.int16 if actual.dtype == torch.float16 else torch.int32
    assert torch.equal(actual[~nan].view(integer), expected[~nan].view(integer))


def wide_range(size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    spread = torch.exp((torch.randn(size, generator=generator) * 4.0).clamp(-20.0, 8.0))
    return (torch.randn(size, generator=generator) * spread).to(dtype)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    finfo = torch.finfo(dtype)
    values = [0.0, -0.0, 1.0, -1.0, 240.0, -247.9, 248.0, 300.0, 57344.0, 61440.0, -1e5,
              2.0**-10, 2.0**-11, 1.5 * 2.0**-11, 2.0**-17, 2.0**-18, 3 * 2.0**-18,
              finfo.tiny, finfo.tiny / 4, -finfo.tiny / 8, finfo.max / 2]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def op(x, fmt_name, margin=0, saturate=True, log2_scale=None):
    return torch.ops.ipu_unit_scaling.fp8_quantise(x, fmt_name, margin, saturate, log2_scale)


CASES = [("F143", 0, True), ("F143", 2, False), ("F152", 0, False), ("F152", 3, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("fmt_name,margin,saturate", CASES)
def test_quantise_equals_the_oracle_on_random_inputs(dtype, fmt_name, margin, saturate):
    for seed, size in enumerate([1, 33, 4096, 300_001]):
        x = wide_range(size, dtype, seed) * 10.0 ** (seed - 2)
        assert_same_bits(op(x, fmt_name, margin, saturate), oracle(x, fmt_name, margin, saturate))
        for scale in (-31, -4, 0, 9, 31):
            assert_same_bits(op(x, fmt_name, margin, saturate, scale),
                             oracle(x, fmt_name, margin, saturate, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("fmt_name,margin,saturate", CASES)
def test_quantise_edge_cases(dtype, fmt_name, margin, saturate):
    x = edge_values(dtype)
    assert_same_bits(op(x, fmt_name, margin, saturate), oracle(x, fmt_name, margin, saturate))
    for scale in (-9, 0, 5):  # given scales overflow the large values
        assert_same_bits(op(x, fmt_name, margin, saturate, scale),
                         oracle(x, fmt_name, margin, saturate, scale))
    zeros = torch.zeros(17, dtype=dtype)
    assert_same_bits(op(zeros, fmt_name, margin, saturate), zeros)
    for shape in [(0,), (3, 0), (0, 2, 5)]:
        empty = torch.empty(shape, dtype=dtype)
        out = op(empty, fmt_name, margin, saturate)
        assert out.shape == shape and out.dtype == dtype


@pytest.mark.parametrize("fmt_name", ["F143", "F152"])
@pytest.mark.parametrize("saturate", [True, False])
def test_a_non_finite_amax_quantises_with_scale_zero(fmt_name, saturate):
    x = torch.tensor([1.0, float("nan"), -3.0, float("inf"), 1e6, 2.0**-30])
    out = op(x, fmt_name, 0, saturate)
    assert_same_bits(out, oracle(x, fmt_name, 0, saturate, log2_scale=0))
    big = FORMAT_MAX[fmt_name] if saturate else float("nan")
    expected = torch.tensor([1.0, float("nan"), -3.0, big, big, 0.0])
    assert_same_bits(out, expected)
    x[1] = 5.0  # an inf alone is non-finite too
    assert_same_bits(op(x, fmt_name, 0, saturate), oracle(x, fmt_name, 0, saturate, 0))


def test_float16_input_near_its_max_can_round_to_inf():
    # amax 65504 gives s = -9 for F143; 65504 * 2**-9 rounds up to 128, and 128 * 2**9 is
    # 65536, past float16's max: documented, and what the oracle gives.
    x = torch.tensor([65504.0, 1.0], dtype=torch.float16)
    out = op(x, "F143")
    assert out[0].item() == float("inf")
    assert_same_bits(out, oracle(x, "F143"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_host_kernel_and_torch_fallback_agree(dtype, monkeypatch):
    require_host_library()
    x = torch.cat([wide_range(50_000, dtype, 7), edge_values(dtype)])
    x_nan = x.clone()
    x_nan[3] = float("nan")
    for fmt_name, margin, saturate in CASES:
        for inputs in (x, x_nan):
            for scale in (None, -3, 4):
                host = _host.fused_quantise(inputs, fmt_name, scale, margin, saturate)
                reference = ops.fp8_quantise_reference(inputs, fmt_name, margin, saturate, scale)
                assert_same_bits(host[0], reference[0])
                assert host[1:] == reference[1:]
    # The op takes the fallback when the library is not there.
    expected = op(x, "F143", 1, True)
    monkeypatch.setattr(_host, "fused_cast_available", lambda: False)
    assert_same_bits(op(x, "F143", 1, True), expected)


def test_the_op_equals_the_emulated_ipu_graph():
    require_host_library()
    for dtype in (torch.float32, torch.float16):
        x = wide_range(1472 * 6 + 5, dtype, 3)
        x[100] = float("inf")
        for fmt_name, margin, saturate in CASES:
            overflow = "saturate" if saturate else "nan"
            for inputs in (x[:99], x):  # a finite amax, then a non-finite one
                values, scale, flag = on_host.fp8_quantise_graph(inputs, fmt_name, margin=margin,
                                                                    overflow=overflow)
                assert flag == (inputs.numel() > 100)
                assert_same_bits(op(inputs, fmt_name, margin, saturate), values)


def test_non_contiguous_input_and_shape():
    x = torch.randn(6, 10)
    assert_same_bits(op(x.t(), "F152"), op(x.t().contiguous(), "F152"))
    assert op(x.t(), "F152").shape == (10, 6)


def test_gradient_of_quantise_passes_straight_through():
    x = (torch.randn(4, 9) * 300).requires_grad_()
    dy = torch.randn(4, 9)
    y = fp8_quantise(x, "F143")
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, dy)
    assert not torch.equal(y, x)  # it did quantise (and saturate nothing: amax scaling)


def test_gradient_quantise_is_the_identity_forward_and_quantises_the_gradient():
    x = torch.randn(5, 8).requires_grad_()
    y = fp8_quantise_gradient(x)
    assert torch.equal(y, x)
    assert y.data_ptr() != x.data_ptr() and y._base is None  # a new tensor, not a view
    dy = wide_range(40, torch.float32, 11).reshape(5, 8) * 1e-4
    (dx,) = torch.autograd.grad(y, x, dy)
    assert_same_bits(dx, oracle(dy, "F152", margin=3))
    assert not torch.equal(dx, dy)
    z = fp8_quantise_gradient(x, F143, margin=0, saturate=False)
    (dx,) = torch.autograd.grad(z, x, dy)
    assert_same_bits(dx, oracle(dy, "F143", 0, False))
    for scale in (0, 12):  # a given scale (static scaling) instead of the amax
        z = fp8_quantise_gradient(x, "F152", margin=3, log2_scale=scale)
        (dx,) = torch.autograd.grad(z, x, dy)
        assert_same_bits(dx, oracle(dy, "F152", 3, True, scale))


def test_gradient_quantise_of_float16_gradients():
    x = torch.randn(64, dtype=torch.float16).requires_grad_()
    dy = wide_range(64, torch.float16, 5)
    (dx,) = torch.autograd.grad(fp8_quantise_gradient(x), x, dy)
    assert dx.dtype == torch.float16
    assert_same_bits(dx, oracle(dy, "F152", 3))


def model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = fp8_quantise(x, "F143") @ fp8_quantise(w, F143, log2_scale=2)
    return fp8_quantise_gradient(torch.relu(h), "F152", margin=3).pow(2).sum()


def call_targets(gm: torch.fx.GraphModule) -> List[str]:
    return [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]


def test_fake_tracing_records_each_op_as_one_node():
    gm = make_fx(model, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 3))
    targets = call_targets(gm)
    assert targets.count("ipu_unit_scaling.fp8_quantise.default") == 2
    assert targets.count("ipu_unit_scaling.fp8_quantise_gradient.default") == 1
    assert not any("_local_scalar_dense" in t or "item" in t for t in targets), targets
    assert all(t.startswith(("aten.", "ipu_unit_scaling.")) for t in targets), targets


def test_tracing_the_backward_records_the_gradient_cast_as_one_node():
    def forward_and_backward(x, w):
        x = x.detach().requires_grad_()
        w = w.detach().requires_grad_()
        return torch.autograd.grad(model(x, w), (x, w))

    gm = make_fx(forward_and_backward, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 3))
    targets = call_targets(gm)
    # Two forward quantises, and the gradient quantise's grad op: one more fp8_quantise.
    assert targets.count("ipu_unit_scaling.fp8_quantise.default") == 3
    assert not any("_local_scalar_dense" in t for t in targets), targets


def test_the_traced_graph_differentiates_like_eager():
    # As PopART does: trace the forward only, then differentiate the traced graph.
    x, w = torch.randn(16, 32) * 4, torch.randn(32, 8) * 0.1
    gm = make_fx(model, tracing_mode="fake")(x, w)
    eager_x, eager_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    traced_x, traced_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    eager_loss = model(eager_x, eager_w)
    eager_loss.backward()
    traced_loss = gm(traced_x, traced_w)
    traced_loss.backward()
    assert torch.equal(traced_loss, eager_loss)
    assert torch.equal(traced_x.grad, eager_x.grad) and torch.equal(traced_w.grad, eager_w.grad)
    # And by the grad-op definitions: straight through the forward quantises, the gradient
    # at the relu quantised to F152 with margin 3.
    qx, qw = op(x, "F143"), op(w, "F143", 0, True, 2)
    h = qx @ qw
    dh = oracle(2 * torch.relu(h), "F152", margin=3) * (h > 0)
    assert torch.allclose(eager_x.grad, dh @ qw.t(), rtol=1e-6, atol=0)
    assert torch.allclose(eager_w.grad, qx.t() @ dh, rtol=1e-6, atol=0)


def test_meta_tensors_keep_shape_and_dtype():
    x = torch.empty(3, 5, dtype=torch.float16, device="meta")
    out = op(x, "F152")
    assert out.device.type == "meta" and out.shape == (3, 5) and out.dtype == torch.float16
    out = torch.ops.ipu_unit_scaling.fp8_quantise_gradient(x, "F152", 3, True)
    assert out.device.type == "meta" and out.shape == (3, 5)


class RecordingOps:
    def __init__(self) -> None:
        self.calls: list = []

    def quantise(self, x, fmt_name, margin, saturate, log2_scale):
        self.calls.append(("quantise", fmt_name, margin, saturate, log2_scale))
        return x + 1

    def quantise_gradient(self, x, fmt_name, margin, saturate, log2_scale=None):
        self.calls.append(("quantise_gradient", fmt_name, margin, saturate, log2_scale))
        return x + 2


def test_ipu_tracing_substitutes_the_custom_op_implementation():
    recorder = RecordingOps()
    x = torch.zeros(3)
    with ipu_tracing(custom_ops=recorder):
        assert torch.equal(fp8_quantise(x, F152, margin=2, log2_scale=-1), x + 1)
        assert torch.equal(fp8_quantise_gradient(x), x + 2)
        assert torch.equal(fp8_quantise_gradient(x, "f143", 0, False, 0), x + 2)
    assert recorder.calls == [("quantise", "F152", 2, True, -1),
                              ("quantise_gradient", "F152", 3, True, None),
                              ("quantise_gradient", "F143", 0, False, 0)]
    with ipu_tracing():  # no implementation given: the torch.library ops
        assert torch.equal(fp8_quantise_gradient(x), x)
    assert len(recorder.calls) == 3


def test_arguments_are_checked_with_clear_errors():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="F143 and F152"):
        fp8_quantise(x, "E4M3FN")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        fp8_quantise(x, "F999")
    with pytest.raises(ValueError, match="margin"):
        fp8_quantise(x, "F143", margin=32)
    with pytest.raises(ValueError, match="log2_scale"):
        fp8_quantise(x, "F143", log2_scale=32)
    with pytest.raises(ValueError, match="saturate"):
        fp8_quantise_gradient(x, saturate=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float32 or float16"):
        fp8_quantise(x.to(torch.bfloat16), "F143")
    with pytest.raises(ValueError, match="format"):
        op(x, "E5M2")  # the op checks too, for direct callers


def test_poptorch_implementation_calls_the_popart_ops(monkeypatch, standin_calls):
    # The IPU backend's implementation, its poptorch.custom_op calls going to the PopTorch
    # stand-in, which runs them as the package's torch.library ops; recorded on the way.
    loaded = []
    monkeypatch.setattr(custom_op, "load_custom_op_library", loaded.append)
    implementation = custom_op.PopTorchFP8CustomOps(poptorch=STANDIN_MODULE)
    x = torch.randn(2, 3, dtype=torch.float16, requires_grad=True)
    with ipu_tracing(custom_ops=implementation):
        y = fp8_quantise(x, "F143", margin=1, log2_scale=4)
        z = fp8_quantise_gradient(x)
    assert y.shape == z.shape == (2, 3) and y.dtype == z.dtype == torch.float16
    # What the PopART ops compute: F143 codes at 2**4, decoded; the identity forward.
    assert torch.equal(y, op(x.detach(), "F143", 1, True, 4))
    assert torch.equal(z, x.detach())
    assert standin_calls == [
        ("Fp8Quantise", "ai.graphcore.unit_scaling", 1,
         {"format": "F143", "margin": 1, "saturate": 1, "has_log2_scale": 1, "log2_scale": 4}),
        ("Fp8GradientQuantise", "ai.graphcore.unit_scaling", 1,
         {"format": "F152", "margin": 3, "saturate": 1, "has_log2_scale": 0, "log2_scale": 0}),
    ]
    assert loaded == [None, None]


def test_python_and_cpp_agree_on_op_names_and_attributes():
    # ScaledIdentity (scaled_identity.cpp) is checked with its own Python side elsewhere.
    # The grouped op (fp8_group_quantise.cpp) is checked below, against its torch op's schema.
    sources = "".join(path.read_text() for path in sorted((REPO / "custom_ops").glob("*.?pp"))
                      if path.name not in ("scaled_identity.cpp", "fp8_group_quantise.cpp"))
    registered = set(re.findall(r'\{kDomain,\s*"(\w+)",\s*1,', sources))
    assert {custom_op.OP_NAME, custom_op.QUANTISE_OP, custom_op.GRADIENT_QUANTISE_OP,
            "Fp8QuantiseGrad", "Fp8GradientQuantiseGrad",
            popxl_codelets.POPXL_OP_NAME} == registered
    assert f'kDomain = "{custom_op.DOMAIN}"' in sources
    read = set(re.findall(r'getAttribute<popart::Attributes::\w+>\(\s*"(\w+)"', sources))
    assert set(custom_op.quantise_attributes("F143", 0, True, 3)) == read


def test_the_grouped_ops_cpp_names_and_attributes_are_its_torch_ops():
    source = (REPO / "custom_ops" / "fp8_group_quantise.cpp").read_text()
    registered = set(re.findall(r'\{kDomain,\s*"(\w+)",\s*1,', source))
    assert registered == {blocks.GROUP_QUANTISE_OP, blocks.GROUP_QUANTISE_OP + "Grad",
                          GROUP_GRADIENT_QUANTISE_OP, GROUP_GRADIENT_QUANTISE_OP + "Grad"}
    read = set(re.findall(r'getAttribute<Attributes::\w+>\(\s*"(\w+)"', source))
    for op in (torch.ops.ipu_unit_scaling.fp8_group_quantise,
               torch.ops.ipu_unit_scaling.fp8_group_quantise_gradient):
        assert read == {argument.name for argument in op.default._schema.arguments[1:]}
    assert read == set(group_quantise_attributes("F143", "row", 0, "amax", "floor", 0, True))

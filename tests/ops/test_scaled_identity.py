"""ScaledIdentity: a unit-scaling scale as one traced op, with the eager form's values and
gradients, on the CPU, in the emulator and through the PopTorch implementation."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from helpers import ROOT as REPO
from helpers import relative_error
from torch.fx.experimental.proxy_tensor import make_fx

import ipu_unit_scaling.ipu as ipu_module
from ipu_standins import poptorch_custom_ops
from ipu_unit_scaling import GPT
from ipu_unit_scaling.backends import standin_op_library
from ipu_unit_scaling.backends.poptorch import fp8_custom_op as custom_op
from ipu_unit_scaling.backends.poptorch_backend import STANDIN_MODULE
from ipu_unit_scaling.ipu import check_poptorch, ipu_tracing, trace_like_poptorch
from ipu_unit_scaling.ops.scaled_identity import composite_scales, scaled_identity
from ipu_unit_scaling.scale import scale

pytestmark = pytest.mark.usefixtures("ops_as_torch_defines_them")
SCALES = [(0.5, 2.0), (1.0, 0.08838834764831845), (1 / math.sqrt(3.0), 1.0),
          (-2.5, 1 / math.sqrt(7.0)), (0.0625, 15.979435765384085)]


def wide_range(size: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(size)
    spread = torch.exp((torch.randn(size, generator=generator) * 3.0).clamp(-12.0, 9.0))
    return (torch.randn(size, generator=generator) * spread).to(dtype)


class Scale(torch.nn.Module):
    def __init__(self, x: torch.Tensor, fwd_scale: float, bwd_scale: float):
        super().__init__()
        self.x = torch.nn.Parameter(x.clone())
        self.scales = (fwd_scale, bwd_scale)

    def forward(self) -> torch.Tensor:
        return scale(self.x, *self.scales)


# ------------------------------------------------------------------------------ numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("fwd_scale,bwd_scale", SCALES)
def test_value_is_one_multiply_and_gradient_another(dtype, fwd_scale, bwd_scale):
    x = wide_range(4099, dtype).requires_grad_()
    dy = wide_range(4101, dtype)[:4099]
    y = scaled_identity(x, fwd_scale, bwd_scale)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, x.detach() * fwd_scale)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, dy * bwd_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_traced_scale_has_the_eager_values_and_gradient_bits(dtype):
    """Under ipu_tracing() the scale is the op: the eager form's multiply each way, for
    infinities and signed zeros too (the composite form turns inf into NaN: inf - inf)."""
    x = torch.cat([wide_range(1000, torch.float32),
                   torch.tensor([float("inf"), -float("inf"), -0.0, 0.0])]).to(dtype)
    dy = wide_range(1004, torch.float32).to(dtype)
    for fwd_scale, bwd_scale in SCALES:
        leaf = x.clone().requires_grad_()
        eager = scale(leaf, fwd_scale, bwd_scale)
        (eager_dx,) = torch.autograd.grad(eager, leaf, dy)
        with ipu_tracing():
            traced = scale(leaf, fwd_scale, bwd_scale)
        (traced_dx,) = torch.autograd.grad(traced, leaf, dy)
        assert torch.equal(traced, eager) and torch.equal(traced.signbit(), eager.signbit())
        assert torch.equal(traced_dx, eager_dx)


def test_composite_form_keeps_the_gradient_and_finite_values():
    x = wide_range(999, torch.float32).requires_grad_()
    dy = wide_range(1001, torch.float32)[:999]
    with ipu_tracing(), composite_scales():
        y = scale(x, 0.25, 3.0)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(y, x.detach() * 0.25)
    assert torch.allclose(dx, dy * 3.0, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------ tracing


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_scale_traces_to_one_node(tracing_mode):
    def traced(x: torch.Tensor) -> torch.Tensor:
        with ipu_tracing():
            return scale(x, 0.5, 4.0)

    graph = make_fx(traced, tracing_mode=tracing_mode)(torch.randn(3, 5))
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.ipu_unit_scaling.scaled_identity.default]


def test_emulator_counts_one_op_and_differentiates_it_by_its_gradient():
    x = wide_range(257, torch.float32)
    module = Scale(x, 0.5, 3.0)
    trace = trace_like_poptorch(module)
    assert trace.report.ok and trace.report.op_counts == {"ipu_unit_scaling::scaled_identity": 1}
    dy = wide_range(259, torch.float32)[:257]
    out = trace()
    out.backward(dy)
    assert torch.equal(out, x * 0.5)
    assert torch.equal(module.x.grad, dy * 3.0)


def test_emulator_accepts_only_the_package_ops_that_have_a_popart_op(monkeypatch):
    module = Scale(torch.randn(4), 0.5, 2.0)
    monkeypatch.setattr(ipu_module, "register_standin_op_library", lambda: None)
    poptorch_custom_ops.unregister_op(custom_op.DOMAIN, custom_op.SCALED_IDENTITY_OP)
    try:
        report = check_poptorch(module, strict=False)
    finally:
        standin_op_library.register_with_standin()
    assert list(report.unsupported) == ["ipu_unit_scaling::scaled_identity"]


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=32, hidden_size=16, depth=2, heads=2, seq_len=8)


@pytest.mark.parametrize("composite", [False, True], ids=["scaled_identity", "composite"])
def test_traced_gpt_has_the_eager_loss_and_gradients(composite):
    model = small_gpt()
    ids, labels = torch.randint(0, 32, (2, 3, 8), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels)
    eager = torch.autograd.grad(loss, list(model.parameters()))
    if composite:
        with composite_scales():
            trace = trace_like_poptorch(model, ids, labels)
    else:
        trace = trace_like_poptorch(model, ids, labels)
    ops = trace.ops()
    assert ("ipu_unit_scaling::scaled_identity" in ops) != composite
    traced_loss = trace(ids, labels)
    traced = torch.autograd.grad(traced_loss, list(model.parameters()))
    assert relative_error(traced_loss, loss) < 1e-6
    for (name, _), e, t in zip(model.named_parameters(), eager, traced):
        assert relative_error(t, e) < 1e-5, name


def test_traced_gpt_op_count_is_within_a_tenth_of_the_gpt_with_plain_multiplies():
    from benchmarks.traced_forms import traced_op_counts
    from benchmarks.variants import Shape

    counts = traced_op_counts(Shape(vocab_size=32, seq_len=8, depth=2, hidden_size=16, heads=2,
                                    batch_size=2))
    assert counts.scaled_identities > 0
    assert counts.ours <= 1.1 * counts.scales_dropped
    # The composite form is a detach, a subtract, a multiply and an add, plus the forward
    # multiply unless it is by 1: three or four ops more per scale, well over the bound.
    assert counts.composite >= counts.ours + 3 * counts.scaled_identities
    assert counts.composite > 1.1 * counts.scales_dropped


# ------------------------------------------------------------------------------ PopTorch


def test_poptorch_implementation_calls_scaled_identity_with_float_attributes(
        monkeypatch, tmp_path, standin_calls):
    library = tmp_path / "libfp8_custom_ops.so"
    library.touch()
    loaded = []
    monkeypatch.setattr(custom_op, "load_custom_op_library", loaded.append)
    # As on the SDK (the library must be loaded), the calls going to the stand-in.
    implementation = custom_op.PopTorchFP8CustomOps(library, poptorch=STANDIN_MODULE)
    x = torch.randn(2, 3, dtype=torch.float16, requires_grad=True)
    with ipu_tracing(custom_ops=implementation):
        y = scale(x, 2, 0.5)
        plain = scale(x, 3.0, 3.0)  # the same scale both ways is a plain multiply
    assert y.dtype == torch.float16 and torch.equal(y, x.detach() * 2.0)
    assert torch.equal(plain, x.detach() * 3.0)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))  # the op's grad: bwd_scale * dy
    assert torch.equal(dx, torch.full_like(dx, 0.5))
    assert standin_calls == [("ScaledIdentity", "ai.graphcore.unit_scaling", 1,
                              {"fwd_scale": 2.0, "bwd_scale": 0.5})]
    assert all(type(v) is float for v in standin_calls[0][3].values())
    assert loaded == [library]


def test_poptorch_implementation_without_the_library_warns_once_and_composes(tmp_path,
                                                                             standin_calls):
    implementation = custom_op.PopTorchFP8CustomOps(tmp_path / "missing.so",
                                                     poptorch=STANDIN_MODULE)
    x = torch.randn(5, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ipu_tracing(custom_ops=implementation):
            y = scale(x, 0.5, 4.0)
            scale(x, 0.25, 2.0)
    assert standin_calls == []
    messages = [str(w.message) for w in caught]
    assert len(caught) == 1 and "missing.so does not exist" in messages[0], messages
    (dx,) = torch.autograd.grad(y, x, torch.ones(5))
    assert torch.equal(y, x.detach() * 0.5) and torch.equal(dx, torch.full((5,), 4.0))


def test_on_the_standin_scales_are_one_op_without_the_library(tmp_path, standin_calls):
    # The stand-in runs the package's ops itself: no PopART library, no composite form.
    implementation = custom_op.PopTorchFP8CustomOps(tmp_path / "missing.so",
                                                    poptorch=STANDIN_MODULE,
                                                    needs_library=False)
    x = torch.randn(5, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ipu_tracing(custom_ops=implementation):
            y = scale(x, 0.5, 4.0)
    assert [call[0] for call in standin_calls] == ["ScaledIdentity"]
    (dx,) = torch.autograd.grad(y, x, torch.ones(5))
    assert torch.equal(y, x.detach() * 0.5) and torch.equal(dx, torch.full((5,), 4.0))


def test_other_custom_op_implementations_get_the_composite_form():
    class FP8Only:
        def quantise(self, x, fmt_name, margin, saturate, log2_scale):
            return x

        def quantise_gradient(self, x, fmt_name, margin, saturate, log2_scale=None):
            return x

    def traced(x: torch.Tensor) -> torch.Tensor:
        with ipu_tracing(custom_ops=FP8Only()):
            return scale(x, 0.5, 4.0)

    graph = make_fx(traced)(torch.randn(3))
    targets = {str(n.target) for n in graph.graph.nodes if n.op == "call_function"}
    assert "aten.sub.Tensor" in targets and not any("scaled_identity" in t for t in targets)


def test_python_and_cpp_agree_on_scaled_identity():
    source = (REPO / "custom_ops" / "scaled_identity.cpp").read_text()
    registered = set(re.findall(r'\{kDomain,\s*"(\w+)",\s*1,', source))
    assert registered == {"ScaledIdentity", "ScaledIdentityGrad", "ScaledIdentityInplace"}
    torch_ops = standin_op_library.HOST_TORCH_OPS
    assert torch_ops[custom_op.SCALED_IDENTITY_OP] == "ipu_unit_scaling::scaled_identity"
    every_source = "".join(p.read_text() for p in (REPO / "custom_ops").glob("*.cpp"))
    every_registered = set(re.findall(r'\{kDomain,\s*"(\w+)",\s*1,', every_source))
    every_registered |= set(re.findall(r'\{kDomain,\s*"(\w+)",\s*1,', (
        REPO / "custom_ops" / "fp8_ops.hpp").read_text()))
    assert set(torch_ops) <= every_registered
    read = set(re.findall(r'requiredScale\(info\.attributes,\s*"(\w+)"\)', source))
    assert read == set(custom_op.scaled_identity_attributes(1.0, 2.0))

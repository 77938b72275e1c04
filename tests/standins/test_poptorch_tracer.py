"""PopTorch semantics without the SDK: every op traced under ipu_tracing() and differentiated
from the traced graph alone (as PopART does) gives eager's values and gradients."""
from __future__ import annotations

import copy
import math
import sys
from typing import Callable, List

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error
from torch import nn

import ipu_unit_scaling as uu
import ipu_unit_scaling.functional as U
from ipu_unit_scaling.backends import build_training_model
from ipu_unit_scaling.fp8 import FP8Config
from ipu_unit_scaling.ipu import (
    PopTorchError,
    check_poptorch,
    ipu_tracing,
    is_ipu_tracing,
    trace_like_poptorch,
)
from ipu_unit_scaling.models import GPTConfig, build_gpt
from ipu_unit_scaling.training.run_config import load_config
from ipu_unit_scaling.transforms import simulate_fp8

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("ops_as_torch_defines_them")]


def _eager_and_traced(module: nn.Module, *inputs: torch.Tensor):
    """(eager output, eager grads, traced output, traced grads) for the sum of squares loss
    (so gradients are not all ones), with grads of parameters and float inputs."""
    leaves = [p for p in module.parameters() if p.requires_grad]
    leaves += [x for x in inputs if x.requires_grad]

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return (out.float() * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum()

    out = module(*inputs)
    eager = torch.autograd.grad(loss_of(out), leaves, allow_unused=True)
    trace = trace_like_poptorch(module, *inputs)
    assert trace.report.ok, str(trace.report)
    traced_out = trace(*inputs)
    traced = torch.autograd.grad(loss_of(traced_out), leaves, allow_unused=True)
    return out, eager, traced_out, traced, trace


class Call(nn.Module):
    """Wraps a functional op; its float arguments are parameters, so gradients reach them."""

    def __init__(self, fn: Callable, *tensors: torch.Tensor):
        super().__init__()
        self.fn = fn
        self.args = nn.ParameterList(
            [nn.Parameter(t) if t.is_floating_point() else nn.Parameter(t, requires_grad=False)
             for t in tensors])

    def forward(self) -> torch.Tensor:
        return self.fn(*self.args)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


OPS = {
    "linear": lambda: Call(U.linear, _randn(3, 5, 8), _randn(6, 8), _randn(6)),
    "linear_to_output_scale": lambda: Call(
        lambda x, w: U.linear(x, w, None, "to_output_scale"), _randn(4, 8), _randn(6, 8)),
    "matmul": lambda: Call(U.matmul, _randn(2, 3, 4, 8), _randn(8, 5)),
    "matmul_vector": lambda: Call(U.matmul, _randn(3, 8), _randn(8)),
    "gelu": lambda: Call(U.gelu, _randn(4, 8)),
    "gelu_tanh": lambda: Call(lambda x: U.gelu(x, approximate="tanh"), _randn(4, 8)),
    "relu": lambda: Call(U.relu, _randn(4, 8)),
    "softmax": lambda: Call(lambda x: U.softmax(x, dim=-1), _randn(4, 8)),
    "layer_norm": lambda: Call(lambda x, w, b: U.layer_norm(x, (8,), w, b),
                               _randn(4, 8), 1 + 0.1 * _randn(8), 0.1 * _randn(8)),
    "embedding": lambda: Call(U.embedding, torch.randint(0, 10, (3, 4)), _randn(10, 8)),
    "add": lambda: Call(lambda a, b: U.add(a, b, alpha=0.5), _randn(4, 8), _randn(8)),
    "residual": lambda: Call(
        lambda x, w: U.residual_add(*_branch(U.residual_split(x, 0.3), w), tau=0.3),
        _randn(4, 8), _randn(8, 8)),
    "sdpa_causal": lambda: Call(lambda q, k, v: U.scaled_dot_product_attention(
        q, k, v, is_causal=True), _randn(2, 2, 5, 4), _randn(2, 2, 5, 4), _randn(2, 2, 5, 4)),
    "sdpa_mask_and_scale": lambda: Call(lambda q, k, v, m: U.scaled_dot_product_attention(
        q, k, v, attn_mask=m, scale=0.3), _randn(2, 5, 4), _randn(2, 6, 4), _randn(2, 6, 4),
        torch.rand(5, 6) > 0.3),
    "sdpa_full": lambda: Call(U.scaled_dot_product_attention,
                              _randn(2, 5, 4), _randn(2, 7, 4), _randn(2, 7, 4)),
    "cross_entropy": lambda: Call(U.cross_entropy, _randn(6, 10), torch.randint(0, 10, (6,))),
    "cross_entropy_sum": lambda: Call(lambda x, t: U.cross_entropy(x, t, reduction="sum"),
                                      _randn(6, 10), torch.randint(0, 10, (6,))),
    "mse_loss": lambda: Call(U.mse_loss, _randn(4, 8), _randn(4, 8)),
    "cross_entropy_ignore_index": lambda: Call(
        lambda x, t: U.cross_entropy(x, t, ignore_index=3), _randn(12, 10),
        torch.tensor([3, 1, 3, 3, 0, 9, 3, 3, 2, 3, 3, 5])),
    "rms_norm": lambda: Call(lambda x, w: U.rms_norm(x, (8,), w, 1e-6),
                             _randn(3, 4, 8), 1 + 0.1 * _randn(8)),
    "silu": lambda: Call(U.silu, _randn(4, 8)),
    "silu_glu": lambda: Call(U.silu_glu, _randn(4, 8), _randn(4, 8)),
    "sdpa_gqa_causal": lambda: Call(lambda q, k, v: U.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True),
        _randn(2, 4, 5, 4), _randn(2, 2, 5, 4), _randn(2, 2, 5, 4)),
}


def _branch(pair, weight):
    branch, skip = pair
    return U.linear(branch, weight), skip


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_traced_has_eager_values_and_gradients(name):
    torch.manual_seed(0)
    module = OPS[name]()
    out, eager, traced_out, traced, _ = _eager_and_traced(module)
    assert torch.equal(out, traced_out) or relative_error(traced_out, out) < 1e-6
    for e, t in zip(eager, traced):
        assert (e is None) == (t is None)
        if e is not None:
            assert relative_error(t, e) < 1e-5, name


def test_dropout_traced_draws_the_same_mask_for_the_same_seed():
    module = Call(lambda x: U.dropout(x, 0.25), _randn(64, 8))
    torch.manual_seed(1)
    eager_out = module()
    trace = trace_like_poptorch(module)
    torch.manual_seed(1)
    assert torch.equal(trace(), eager_out)


@pytest.mark.parametrize("dropout", [
    lambda x: F.dropout(x, 0.25), lambda x: U.dropout(x, 0.25), lambda x: F.dropout2d(x, 0.25),
    lambda x: torch.ops.aten.dropout.default(x, 0.25, True),  # as a torch.export graph calls it
], ids=["F.dropout", "U.dropout", "F.dropout2d", "aten.dropout"])
def test_dropout_in_training_mode_is_one_op_as_poptorch_sees_it(dropout):
    """PopTorch's dispatcher implements aten::dropout and aten::feature_dropout itself, so the
    empty_like that PyTorch's decomposition would make never reaches it. Ops outside the
    dropout are still checked."""
    report = check_poptorch(Call(dropout, _randn(4, 3, 8, 8)))
    assert report.ok
    unsupported = check_poptorch(Call(lambda x: torch.special.i0(dropout(x)), _randn(4, 3, 8, 8)),
                                 strict=False)
    assert list(unsupported.unsupported) == ["aten::i0"]


MODULES = {
    "Linear": lambda: (uu.Linear(8, 6), _randn(3, 8)),
    "LayerNorm": lambda: (uu.LayerNorm(8), _randn(3, 8)),
    "GELU": lambda: (nn.Sequential(uu.Linear(8, 8), uu.GELU()), _randn(3, 8)),
    "ReLU": lambda: (nn.Sequential(uu.Linear(8, 8), uu.ReLU()), _randn(3, 8)),
    "Softmax": lambda: (nn.Sequential(uu.Linear(8, 8), uu.Softmax(dim=-1)), _randn(3, 8)),
    "MHSA": lambda: (uu.SelfAttention(16, 4), _randn(2, 6, 16)),
    "MLP": lambda: (uu.FeedForward(16), _randn(2, 6, 16)),
    "TransformerLayer": lambda: (uu.TransformerBlock(16, 2, bias=True), _randn(2, 6, 16)),
    "RMSNorm": lambda: (nn.Sequential(uu.Linear(8, 8), uu.RMSNorm(8)), _randn(3, 8)),
    "SiLU": lambda: (nn.Sequential(uu.Linear(8, 8), uu.SiLU()), _randn(3, 8)),
    "GatedMLP": lambda: (uu.GatedMLP(16, 40), _randn(2, 6, 16)),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_traced_has_eager_gradients(name):
    torch.manual_seed(0)
    module, x = MODULES[name]()
    x.requires_grad_()
    out, eager, traced_out, traced, _ = _eager_and_traced(module, x)
    assert relative_error(traced_out, out) < 1e-6
    for e, t in zip(eager, traced):
        assert relative_error(t, e) < 1e-5, name


def _decoder(**kwargs) -> uu.GPT:
    torch.manual_seed(0)
    return uu.GPT(vocab_size=32, hidden_size=16, depth=2, heads=2, seq_len=8,
                                 **kwargs)


def _loss_and_gradients(run: Callable[[], torch.Tensor], model: nn.Module):
    model.zero_grad(set_to_none=True)
    loss = run()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs", [{}, {"bias": True, "attn_tau": 0.5}],
                         ids=["default", "bias"])
def test_real_decoder_traced_matches_eager_loss_and_every_gradient(kwargs):
    model = _decoder(**kwargs)
    generator = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 32, (2, 3, 8), generator=generator)
    eager_loss, eager = _loss_and_gradients(lambda: model(ids, labels), model)
    trace = trace_like_poptorch(model, ids, labels)
    assert trace.report.ok, str(trace.report)
    traced_loss, traced = _loss_and_gradients(lambda: trace(ids, labels), model)
    assert relative_error(traced_loss, eager_loss) < 1e-6
    for (name, _), e, t in zip(model.named_parameters(), eager, traced):
        assert relative_error(t, e) < 1e-5, name


def test_without_the_traced_forms_the_gradients_are_wrong():
    # What the IPU computed before the traced forms: PopART drops every custom backward.
    model = _decoder()
    ids, labels = torch.randint(0, 32, (2, 3, 8), generator=torch.Generator().manual_seed(1))
    _, eager = _loss_and_gradients(lambda: model(ids, labels), model)
    with pytest.MonkeyPatch.context() as patch:
        # The scales keep their eager form (a custom autograd Function) while tracing.
        primitive = sys.modules["ipu_unit_scaling.ops.scaling_primitive"]
        patch.setattr(primitive, "is_ipu_tracing", lambda: False)
        trace = trace_like_poptorch(model, ids, labels)
    _, traced = _loss_and_gradients(lambda: trace(ids, labels), model)
    errors = [relative_error(t, e) for e, t in zip(eager, traced)]
    # The loss's count-based grad scale is the same op in both forms, so the parameter nearest
    # the loss loses only part of its scale; every other one is off by more than half.
    assert min(errors) > 0.1
    assert sorted(errors)[1] > 0.5


def test_unit_scale_converted_model_traced_matches_eager():
    from ipu_unit_scaling.transforms import unit_scale

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model = unit_scale(plain)
    x = _randn(5, 8).requires_grad_()
    out, eager, traced_out, traced, _ = _eager_and_traced(model, x)
    assert relative_error(traced_out, out) < 1e-6
    for e, t in zip(eager, traced):
        assert relative_error(t, e) < 1e-5


# ---------------------------------------------------------------- what PopTorch refuses


class ReadsAScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        return y * self.inner.weight.abs().max().item()


class Branches(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


def test_item_is_refused_naming_the_call_and_the_module():
    model = nn.Sequential(ReadsAScalar())
    with pytest.raises(PopTorchError, match=r"_local_scalar_dense in 0\b.*\.item\(\)"):
        check_poptorch(model, torch.randn(2, 4))


def test_data_dependent_control_flow_is_refused():
    with pytest.raises(PopTorchError, match="control flow"):
        check_poptorch(Branches(), torch.randn(2, 4))


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fnuz"), reason="torch has no float8 dtypes")
def test_float8_tensors_are_refused():
    class Casts(nn.Module):
        def forward(self, x):
            return x.to(torch.float8_e4m3fnuz).to(torch.float32)

    with pytest.raises(PopTorchError, match="float8"):
        check_poptorch(Casts(), torch.randn(2, 4))


def test_unsupported_ops_are_reported_with_their_module():
    class InverseErf(nn.Module):
        def forward(self, x):
            return torch.erfinv(torch.tanh(x))

    model = nn.Sequential(nn.Linear(4, 4), InverseErf())
    report = check_poptorch(model, torch.randn(1, 3, 4), strict=False)
    # erfinv has no handler in PopTorch; it comes from the module "1".
    assert report.unsupported == {"aten::erfinv": ["1"]}
    with pytest.raises(PopTorchError, match=r"unsupported op.*\n  aten::erfinv in 1"):
        check_poptorch(model, torch.randn(1, 3, 4))


def test_fused_attention_traces_with_supported_ops_only_through_u():
    class FusedAttention(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    # How torch decomposes the fused op depends on its version: on 2.0.1 into ops PopTorch
    # handles once the causal mask is folded as a constant, on newer torch into ops it has
    # no handler for. Whatever is reported comes from the attention module, "1".
    model = nn.Sequential(nn.Linear(4, 4), FusedAttention())
    report = check_poptorch(model, torch.randn(1, 3, 4), strict=False)
    assert all(set(modules) == {"1"} for modules in report.unsupported.values())
    # The same attention through U traces with supported ops only, under ipu_tracing().
    assert check_poptorch(Call(lambda q: U.scaled_dot_product_attention(q, q, q, is_causal=True),
                               torch.randn(1, 3, 4))).ok


class TimesThreeBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


def test_custom_backward_is_dropped_as_poptorch_drops_it():
    weight = nn.Parameter(torch.randn(4))

    class UsesCustomBackward(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            return TimesThreeBackward.apply(self.weight * x).sum()

    model, x = UsesCustomBackward(), torch.randn(4)
    (eager,) = torch.autograd.grad(model(x), [weight])
    (traced,) = torch.autograd.grad(trace_like_poptorch(model, x)(x), [weight])
    assert torch.allclose(eager, 3 * x)  # the custom backward
    assert torch.allclose(traced, 2 * x)  # the derivative of the forward: what PopART computes


def test_ipu_tracing_is_a_scoped_switch():
    assert not is_ipu_tracing()
    with ipu_tracing():
        assert is_ipu_tracing()
        with ipu_tracing():
            assert is_ipu_tracing()
        assert is_ipu_tracing()
    assert not is_ipu_tracing()


def test_eager_form_is_unchanged_outside_the_switch():
    model = _decoder()
    ids = torch.randint(0, 32, (2, 8))
    ops: List[str] = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            ops.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Record():
        model(ids, ids)
    assert "scaled_dot_product_attention" in ops  # the fused op, not the explicit one


# ---------------------------------------------------------------- the emulator backend


def _shrunk_ipu2(extra: List[str]):
    return load_config("ipu-2", [
        "model.depth=2", "model.hidden_size=16", "model.heads=2", "model.seq_len=8",
        "ipu.layers_per_ipu=[1, 1]", "ipu.device_iterations=2", "ipu.gradient_accumulation=4",
        "ipu.executable_cache_dir=null", "training.batch_size=8", *extra])


@pytest.mark.parametrize("precision, tolerance", [
    ("precision.dtype=fp32", 1e-5),
    ("precision.fp8.scaling=amax", 1e-3),
    ("precision.fp8.scaling=static", 1e-3),
], ids=["fp32", "fp8-amax", "fp8-static"])
def test_emulator_backend_trains_like_the_cpu_backend_for_20_steps(precision, tolerance,
                                                                   step_losses):
    config = _shrunk_ipu2([precision])
    calls = 20 // config.ipu.device_iterations
    cpu = step_losses(config, "cpu", calls)
    emulated = step_losses(copy.deepcopy(config), "emulator", calls)
    assert cpu.shape == (20,)
    assert cpu[-1] < cpu[0]
    assert torch.allclose(emulated, cpu, rtol=tolerance, atol=0)


def test_emulator_backend_refuses_a_model_poptorch_would_refuse():
    config = _shrunk_ipu2([])
    model = nn.Sequential(ReadsAScalar())

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([model, nn.Identity()])

        def forward(self, ids, labels, return_logits=False):
            out = self.layers[0](ids.float().unsqueeze(-1).expand(*ids.shape, 4))
            loss = out.mean()
            return (loss, out) if return_logits else loss

    wrapped = Wrapped()
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    wrapper = build_training_model(wrapped, optimizer, config, backend="emulator")
    ids = torch.randint(0, 8, (config.samples_per_call, 8))
    with pytest.raises(PopTorchError, match="item"):
        wrapper(ids, ids)


PRECISIONS = {
    "fp32": None,
    "fp16": "fp16",
    "fp8-amax": FP8Config(),
    "fp8-static": FP8Config(scaling="static"),
    "fp8-amax-attention": FP8Config(attention=True),
}


def _gpt_in(precision: str, unit_scaled: bool = True, parametrization: str = "unit",
            **umup_keys: float) -> nn.Module:
    from ipu_unit_scaling.training.precision import simulate_fp16

    torch.manual_seed(0)
    model = build_gpt(GPTConfig(vocab_size=32, seq_len=8, depth=2, hidden_size=16, heads=2,
                                unit_scaled=unit_scaled, parametrization=parametrization,
                                **umup_keys))
    setting = PRECISIONS[precision]
    if setting == "fp16":
        return simulate_fp16(model)
    if isinstance(setting, FP8Config):
        return simulate_fp8(model, setting)
    return model


@pytest.mark.parametrize("unit_scaled", [True, False], ids=["unit", "plain"])
@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_gpt_in_every_precision_traces_with_supported_ops_only(precision, unit_scaled):
    model = _gpt_in(precision, unit_scaled)
    ids = torch.randint(0, 32, (2, 8))
    report = check_poptorch(model, ids, ids)
    assert report.ok
    fp8_ops = sum(n for op, n in report.op_counts.items()
                  if op.startswith("ipu_unit_scaling::fp8_"))
    assert (fp8_ops > 0) == precision.startswith("fp8")
    scales = report.op_counts.get("ipu_unit_scaling::scaled_identity", 0)
    assert (scales > 0) == unit_scaled


def _traced_against_eager_tolerance(precision: str, model: nn.Module) -> float:
    """Relative error allowed between the traced and the eager loss and gradients.

    fp32: 1e-5, about 170 float32 unit roundoffs (2**-24 = 6e-8): a <= 64-term sum reordered
    differs by at most 64 * 2**-24 = 3.8e-6, and a few such ops lie between a gradient and the
    loss. FP8: the casts see the same tensors in both graphs, so the same float32 bound with
    room (1e-4), far below one FP8 step.

    fp16: the two graphs cast float32 values that differ by the order of their sums, at most
    eps = 64 * 2**-24 relative (the widest sum here is the 64-wide FFN). A cast to float16
    (unit roundoff u = 2**-11 = 4.9e-4) then rounds them to different neighbours only where a
    value lies within eps of a rounding boundary, a fraction eps / u of the casts, and those
    elements differ by one step, 2u: a mean square relative difference of at most
    (eps / u) (2u)**2 = 4 eps u per cast. Every FP16Linear casts six tensors (input, weight,
    output; their three gradients), so the R casts before a gradient add up to at most
    4 eps u R: a relative error of 2 sqrt(eps u R) (6.3e-4 for R = 54 here), taken three times
    over because a 16-element tensor (a norm weight) holds only a handful of such elements:
    1.9e-3, against the 0.5 that a gradient scale off by 2x gives.
    """
    if precision == "fp32":
        return 1e-5
    if precision != "fp16":
        return 1e-4
    from ipu_unit_scaling.training.precision import FP16Linear

    casts = 6 * sum(isinstance(m, FP16Linear) for m in model.modules())
    eps, unit = 64 * 2.0**-24, 2.0**-11
    return 3 * 2 * math.sqrt(eps * unit * casts)


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_gpt_in_every_precision_traced_matches_eager(precision):
    # FP8 traced and eager cast the same tensors with the same codes; only the order of
    # float32 sums may differ, far below one FP8 rounding step (2**-3 relative for F143).
    model = _gpt_in(precision)
    ids, labels = torch.randint(0, 32, (2, 3, 8), generator=torch.Generator().manual_seed(2))
    eager_loss, eager = _loss_and_gradients(lambda: model(ids, labels), model)
    trace = trace_like_poptorch(model, ids, labels)
    traced_loss, traced = _loss_and_gradients(lambda: trace(ids, labels), model)
    tolerance = _traced_against_eager_tolerance(precision, model)
    assert relative_error(traced_loss, eager_loss) < tolerance
    for (name, _), e, t in zip(model.named_parameters(), eager, traced):
        assert relative_error(t, e) < tolerance, name


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
def test_umup_gpt_traces_with_supported_ops_and_matches_eager(precision):
    # u-μP adds per-layer taus, 1/head_dim attention, a scaled gelu and a forward-only logit
    # scale (multipliers away from 1, so that each of them is in the graph).
    model = _gpt_in(precision, parametrization="u-mup", attn_softmax_mult=2.0,
                    ffn_act_mult=0.5, loss_softmax_mult=3.0, residual_mult=1.5)
    ids, labels = torch.randint(0, 32, (2, 3, 8), generator=torch.Generator().manual_seed(2))
    report = check_poptorch(model, ids, labels)
    assert report.ok, str(report)
    eager_loss, eager = _loss_and_gradients(lambda: model(ids, labels), model)
    trace = trace_like_poptorch(model, ids, labels)
    traced_loss, traced = _loss_and_gradients(lambda: trace(ids, labels), model)
    tolerance = _traced_against_eager_tolerance(precision, model)
    assert relative_error(traced_loss, eager_loss) < tolerance
    for (name, _), e, t in zip(model.named_parameters(), eager, traced):
        assert relative_error(t, e) < tolerance, name


def test_umup_emulator_backend_trains_like_the_cpu_backend(step_losses):
    # The emulator's gradients come from the traced graph; with u-μP's per-group learning
    # rates, pipelined with gradient accumulation, 10 steps give the CPU backend's losses.
    config = _shrunk_ipu2(["precision.dtype=fp32", "model.parametrization=u-mup",
                           "training.learning_rate=1.0"])
    cpu = step_losses(config, "cpu", 5)
    emulated = step_losses(copy.deepcopy(config), "emulator", 5)
    assert len(set(cpu.tolist())) == len(cpu)  # every step moved the weights
    # Eager's fused kernels and the traced composition round float32 differently, and the
    # emulator steps PopART's Adam where the CPU backend steps torch's (the same rule, other
    # rounding). Each step's update is a float32 sum (u = 2**-24) over at most 2**10 rounded
    # terms, and a step's difference carries into the next: at most steps * 2**10 * u of
    # the loss (6.1e-4 over ten steps), far below what a wrong per-group learning rate does
    # at eta = 1.
    steps = len(cpu)
    assert torch.allclose(emulated, cpu, rtol=steps * 2**10 * 2**-24, atol=0)


def test_fp16_gradients_are_rounded_in_the_traced_graph_too():
    from ipu_unit_scaling.training.precision import round_to_half

    weight = nn.Parameter(torch.tensor([1.0001, 3.14159265]))
    module = Call(lambda w: round_to_half(w) * torch.tensor([1.0001, 2.71828182]), weight.data)
    (traced,) = torch.autograd.grad(trace_like_poptorch(module)().sum(), list(module.parameters()))
    assert torch.equal(traced, torch.tensor([1.0001, 2.71828182]).half().float())


def test_stochastic_rounding_is_refused_in_the_poptorch_form():
    model = _gpt_in("fp32")
    simulate_fp8(model, FP8Config(rounding="stochastic"))
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match="stochastic"):
        check_poptorch(model, ids, ids)


def test_a_model_compiled_under_inference_mode_sees_composite_ops_decomposed():
    """Under ``torch.inference_mode`` ``F.mse_loss``'s ``broadcast_tensors`` reaches the trace
    whole; PopTorch's dispatcher sees the expands it is made of, and compiles it."""
    import ipu_standins.poptorch as poptorch

    class Loss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.fc(x), x)

    model, x = Loss(), torch.rand(4, 3)
    with torch.inference_mode():
        out = poptorch.inferenceModel(model)(x)
        expected = model(x)
    torch.testing.assert_close(out, expected)

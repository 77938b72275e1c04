"""Code written for unit-scaling 0.3.5 (Graphcore Research's library) runs here with only its
import changed, keeps u-μP's rules, and runs on this package's backends.

The example model below uses only the library's public API, as its documentation composes it;
the u-μP rules are checked against the library's documented formulas, recomputed here in
float64 (dense-grid integrals over the normal density, not the package's quadrature).
"""
from __future__ import annotations

import copy
import inspect
import math
import pickle
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ipu_unit_scaling as uu
import ipu_unit_scaling.functional as U
from ipu_unit_scaling import transforms
from ipu_unit_scaling.ipu import check_poptorch, trace_like_poptorch

DYNAMO_INLINES_MODULES = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 1)
needs_dynamo = pytest.mark.skipif(
    not DYNAMO_INLINES_MODULES,
    reason="graph transforms capture with TorchDynamo, which traces into nn modules from 2.1")

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 64, 32, 2, 4, 16


# ---------------------------------------------------------------- the library's example model


class LibraryStyleDecoder(nn.Module):
    """unit-scaling's u-μP decoder, written with its public API only."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = uu.Embedding(VOCAB, HIDDEN)
        rule = uu.transformer_residual_scaling_rule(residual_mult=1.0, residual_attn_ratio=1.0)
        self.layers = uu.DepthSequential(*(
            uu.TransformerLayer(HIDDEN, HEADS, mhsa_tau=rule(2 * i, 2 * LAYERS),
                                mlp_tau=rule(2 * i + 1, 2 * LAYERS), is_causal=True)
            for i in range(LAYERS)))
        self.final_norm = uu.RMSNorm(HIDDEN)
        self.projection = uu.LinearReadout(HIDDEN, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        return self.projection(self.final_norm(self.layers(self.embedding(ids))))


def next_token_loss(model: nn.Module, ids: Tensor) -> Tensor:
    logits = model(ids)
    return U.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class LossOf(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return next_token_loss(self.model, ids)


def arithmetic_sequences(generator: torch.Generator, batch: int = 16) -> Tensor:
    """Token sequences start, start + step, ... (mod VOCAB): the next token is predictable."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=generator)
    step = torch.randint(1, 4, (batch, 1), generator=generator)
    return (start + step * torch.arange(SEQ)) % VOCAB


MODELS: Dict[str, Callable[[], nn.Module]] = {
    "written with the API": LibraryStyleDecoder,
    "uu.TransformerDecoder": lambda: uu.TransformerDecoder(HIDDEN, VOCAB, LAYERS, HEADS),
}


def train(model: nn.Module, steps: int) -> List[float]:
    optimizer = uu.optim.AdamW(model.parameters(), lr=1.0)  # u-μP's rates: lr near 1
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = next_token_loss(model, arithmetic_sequences(generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_library_model_starts_at_chance_and_trains_on_cpu(make):
    torch.manual_seed(0)
    losses = train(make(), steps=25)
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)  # unit logits: near chance
    assert np.mean(losses[-5:]) < 0.35 * losses[0], losses


def test_written_model_is_the_library_decoder():
    torch.manual_seed(0)
    written = LibraryStyleDecoder()
    torch.manual_seed(0)
    library = uu.TransformerDecoder(HIDDEN, VOCAB, LAYERS, HEADS)
    ids = arithmetic_sequences(torch.Generator().manual_seed(2))
    assert torch.equal(written(ids), library(ids))
    assert library.loss(ids).item() == next_token_loss(written, ids).item()


@needs_dynamo
def test_library_model_trains_under_simulate_fp8():
    torch.manual_seed(0)
    model = LibraryStyleDecoder()
    fp8 = transforms.simulate_fp8(model)
    ids = arithmetic_sequences(torch.Generator().manual_seed(2))
    exact, cast = model(ids), fp8(ids)
    assert not torch.equal(exact, cast)  # the matmuls see FP8 values
    relative = (cast - exact).norm() / exact.norm()
    assert 1e-3 < relative.item() < 0.15  # E4M3 rounds by at most 1/16 relative
    losses = train(fp8, steps=20)
    assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
    assert model.embedding.weight.grad is None  # the copy trained, not the model


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_library_model_traces_like_poptorch_with_eager_gradients(make):
    torch.manual_seed(0)
    wrapped = LossOf(make())
    ids = arithmetic_sequences(torch.Generator().manual_seed(2))
    report = check_poptorch(wrapped, ids)
    assert report.ok
    parameters = list(wrapped.parameters())
    traced_loss = trace_like_poptorch(wrapped, ids)(ids)
    eager_loss = wrapped(ids)
    traced = torch.autograd.grad(traced_loss, parameters)
    eager = torch.autograd.grad(eager_loss, parameters)
    torch.testing.assert_close(traced_loss, eager_loss, rtol=1e-6, atol=0)
    for got, want in zip(traced, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_library_rules_trace_like_poptorch_with_eager_gradients():
    # Inside uu.rules("unit-scaling") the ops' PopTorch forms follow the library's rules too:
    # the traced loss and gradients are the eager ones under the switch, and not ours.
    torch.manual_seed(0)
    wrapped = LossOf(LibraryStyleDecoder())
    ids = arithmetic_sequences(torch.Generator().manual_seed(2))
    parameters = list(wrapped.parameters())
    with uu.rules("unit-scaling"):
        traced_loss = trace_like_poptorch(wrapped, ids)(ids)
        eager_loss = wrapped(ids)
        traced = torch.autograd.grad(traced_loss, parameters)
        eager = torch.autograd.grad(eager_loss, parameters)
    ours = torch.autograd.grad(wrapped(ids), parameters)
    # As in the test above: float32 rounding of a traced graph whose ops run in another order.
    torch.testing.assert_close(traced_loss, eager_loss, rtol=1e-6, atol=0)
    for got, want in zip(traced, eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, eager)) > 1e-2


# ---------------------------------------------------------------- signatures and defaults


# (name, default) of unit-scaling 0.3.5's leading parameters, in its order (empty: required).
# Where the library requires an argument that has a default here (linear's bias), the default
# is listed: the library's calls still fit.
_REQUIRED = inspect.Parameter.empty
LIBRARY_SIGNATURES: Dict[Callable[..., Any], List[Any]] = {
    U.gelu: [("input", _REQUIRED), ("mult", 1.0), ("constraint", "to_output_scale"),
             ("approximate", "none")],
    U.silu: [("input", _REQUIRED), ("mult", 1.0), ("constraint", "to_output_scale"),
             ("inplace", False)],
    U.silu_glu: [("input", _REQUIRED), ("gate", _REQUIRED), ("mult", 1.0)],
    U.softmax: [("input", _REQUIRED), ("dim", _REQUIRED), ("dtype", None),
                ("constraint", "to_output_scale"), ("mult", 1.0)],
    U.matmul: [("left", _REQUIRED), ("right", _REQUIRED), ("constraint", "to_output_scale")],
    U.linear: [("input", _REQUIRED), ("weight", _REQUIRED), ("bias", None),
               ("constraint", "to_output_scale"), ("scale_power", (0.5, 0.5, 0.5))],
    U.linear_readout: [("input", _REQUIRED), ("weight", _REQUIRED), ("bias", None),
                       ("constraint", None)],
    U.conv1d: [("input", _REQUIRED), ("weight", _REQUIRED), ("bias", None), ("stride", 1),
               ("padding", 0), ("dilation", 1), ("groups", 1),
               ("constraint", "to_output_scale")],
    U.add: [("input", _REQUIRED), ("other", _REQUIRED), ("constraint", "to_output_scale"),
            ("alpha", 1.0), ("out", None)],
    U.rms_norm: [("input", _REQUIRED), ("normalized_shape", _REQUIRED), ("weight", None),
                 ("eps", 1e-5)],
    U.scaled_dot_product_attention: [
        ("query", _REQUIRED), ("key", _REQUIRED), ("value", _REQUIRED), ("attn_mask", None),
        ("dropout_p", 0.0), ("is_causal", False), ("mult", 1.0)],
    U.cross_entropy: [("input", _REQUIRED), ("target", _REQUIRED), ("weight", None),
                      ("size_average", None), ("ignore_index", -100), ("reduce", None),
                      ("reduction", "mean"), ("label_smoothing", 0.0), ("mult", 1.0)],
    U.mse_loss: [("input", _REQUIRED), ("target", _REQUIRED), ("size_average", None),
                 ("reduce", None), ("reduction", "mean")],
    U.residual_apply: [("fn", _REQUIRED), ("input", _REQUIRED), ("tau", 1.0)],
    uu.Linear: [("in_features", _REQUIRED), ("out_features", _REQUIRED), ("bias", False),
                ("device", None), ("dtype", None), ("constraint", "to_output_scale"),
                ("weight_mup_type", "weight")],
    uu.LinearReadout: [("in_features", _REQUIRED), ("out_features", _REQUIRED),
                       ("bias", False), ("device", None), ("dtype", None),
                       ("constraint", None), ("weight_mup_type", "output")],
    uu.LayerNorm: [("normalized_shape", _REQUIRED), ("eps", 1e-5),
                   ("elementwise_affine", False), ("bias", True)],
    uu.RMSNorm: [("normalized_shape", _REQUIRED), ("eps", 1e-5), ("elementwise_affine", False)],
    uu.GELU: [("mult", 1.0), ("constraint", "to_output_scale"), ("approximate", "none")],
    uu.SiLU: [("mult", 1.0), ("constraint", "to_output_scale"), ("inplace", False)],
    uu.CrossEntropyLoss: [("mult", 1.0), ("weight", None), ("size_average", None),
                          ("ignore_index", -100), ("reduce", None), ("reduction", "mean"),
                          ("label_smoothing", 0.0)],
    uu.MHSA: [("hidden_size", _REQUIRED), ("heads", _REQUIRED), ("is_causal", _REQUIRED),
              ("dropout_p", 0.0), ("mult", 1.0)],
    uu.MLP: [("hidden_size", _REQUIRED), ("expansion_factor", 4)],
    uu.TransformerLayer: [("hidden_size", _REQUIRED), ("heads", _REQUIRED),
                          ("mhsa_tau", _REQUIRED), ("mlp_tau", _REQUIRED),
                          ("is_causal", _REQUIRED), ("dropout_p", 0.0)],
    uu.TransformerDecoder: [("hidden_size", _REQUIRED), ("vocab_size", _REQUIRED),
                            ("layers", _REQUIRED), ("heads", _REQUIRED), ("dropout_p", 0.0)],
    uu.Parameter: [("data", _REQUIRED), ("mup_type", _REQUIRED), ("mup_scaling_depth", None)],
    uu.optim.scaled_parameters: [
        ("params", _REQUIRED), ("lr_scale_func", _REQUIRED), ("lr", None), ("weight_decay", 0),
        ("independent_weight_decay", True), ("allow_non_unit_scaling_params", False)],
}


@pytest.mark.parametrize("target", LIBRARY_SIGNATURES, ids=lambda t: t.__qualname__)
def test_signatures_start_with_the_library_parameters_and_defaults(target):
    parameters = list(inspect.signature(target).parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    expected = LIBRARY_SIGNATURES[target]
    got = [(p.name, p.default) for p in parameters[:len(expected)]]
    assert got == expected


def test_ops_default_to_the_output_scale_constraint():
    torch.manual_seed(0)
    x = torch.randn(512, 256, requires_grad=True)
    out = U.linear(x, torch.randn(1024, 256))
    out.backward(torch.randn_like(out))
    assert out.std().item() == pytest.approx(1.0, abs=0.05)  # unit output...
    assert x.grad.std().item() == pytest.approx(2.0, abs=0.1)  # ...and sqrt(1024 / 256) back


def test_constraints_return_one_scale():
    assert uu.constraints.gmean(8.0, 2.0) == 4.0
    assert uu.constraints.to_output_scale(2.0, 3.0, 4.0) == 2.0
    assert uu.constraints.to_left_grad_scale(1.0, 2.0, 3.0) == 2.0
    assert uu.constraints.to_right_grad_scale(1.0, 2.0, 3.0) == 3.0
    assert uu.constraints.apply_constraint("hmean", 8.0, 2.0) == (3.2, 3.2)
    assert uu.constraints.apply_constraint(None, 8.0, 2.0) == (8.0, 2.0)


def test_earlier_positional_forms_still_work():
    x = torch.randn(64, 32)
    torch.testing.assert_close(U.gelu(x, "tanh"), U.gelu(x, approximate="tanh"))
    torch.testing.assert_close(U.add(x, x, 1.0, "gmean"), U.add(x, x, "gmean"))
    torch.testing.assert_close(U.silu_glu(x, x, "gmean"), U.silu_glu(x, x, constraint="gmean"))
    with pytest.raises(ValueError, match="inplace"):
        U.silu(x, True)


# ---------------------------------------------------------------- u-μP: mult on each op

_GRID = torch.linspace(-14.0, 14.0, 2_000_001, dtype=torch.float64)
_DENSITY = torch.exp(-0.5 * _GRID**2) / math.sqrt(2 * math.pi)


def _normal_mean(values: Tensor) -> float:
    return torch.trapezoid(values * _DENSITY, _GRID).item()


def _normal_std(values: Tensor) -> float:
    return math.sqrt(_normal_mean(values**2) - _normal_mean(values) ** 2)


def _normal_rms(values: Tensor) -> float:
    return math.sqrt(_normal_mean(values**2))


def _gelu(z: Tensor) -> Tensor:
    return z * 0.5 * (1 + torch.special.erf(z / math.sqrt(2)))


def _gelu_slope(z: Tensor) -> Tensor:
    return 0.5 * (1 + torch.special.erf(z / math.sqrt(2))) + z * torch.exp(-0.5 * z**2) / (
        math.sqrt(2 * math.pi))


def _ratio_is_constant(a: Tensor, b: Tensor) -> float:
    """a / b where b is not tiny, checked constant to 1e-9 relative; returns the constant."""
    keep = b.abs() > 1e-6
    ratio = (a[keep] / b[keep]).double()
    assert (ratio.max() - ratio.min()).item() <= 1e-9 * ratio.abs().max().item()
    return ratio.mean().item()


def _unit_normal_call(op: Callable[[Tensor], Tensor], size: int = 4096
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, generator=generator, dtype=torch.float64, requires_grad=True)
    out = op(x)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    out.backward(grad)
    return x.detach(), out.detach(), grad, x.grad  # type: ignore[return-value]


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
def test_gelu_mult_is_gelu_of_mult_x_with_exact_unit_scales(mult):
    """unit-scaling documents `gelu(x, mult)` as `gelu(mult x) / mult`, unit-scaled; here the
    scales are 1/std(gelu(mult z)) forward and 1/rms(d/dz gelu(mult z)) backward, to 1e-4 (the
    package's 160-point quadrature is 4e-5 off the dense integral at mult 4, where gelu' turns
    sharply)."""
    x, out, grad, x_grad = _unit_normal_call(lambda x: U.gelu(x, mult=mult, constraint=None))
    output_scale = _ratio_is_constant(out, F.gelu(mult * x))
    grad_scale = _ratio_is_constant(x_grad, grad * mult * _torch_gelu_slope(mult * x))
    z = mult * _GRID
    assert output_scale == pytest.approx(1 / _normal_std(_gelu(z)), rel=1e-4)
    assert grad_scale == pytest.approx(1 / _normal_rms(mult * _gelu_slope(z)), rel=1e-4)


def _torch_gelu_slope(x: Tensor) -> Tensor:
    z = x.clone().requires_grad_()
    (slope,) = torch.autograd.grad(F.gelu(z).sum(), z)
    return slope


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
def test_silu_mult_is_x_sigmoid_mult_x_with_exact_unit_scales(mult):
    x, out, grad, x_grad = _unit_normal_call(lambda x: U.silu(x, mult=mult, constraint=None))
    output_scale = _ratio_is_constant(out, x * torch.sigmoid(mult * x))
    s = torch.sigmoid(mult * x)
    grad_scale = _ratio_is_constant(x_grad, grad * s * (1 + mult * x * (1 - s)))
    sg = torch.sigmoid(mult * _GRID)
    assert output_scale == pytest.approx(1 / _normal_std(_GRID * sg), rel=1e-4)
    assert grad_scale == pytest.approx(1 / _normal_rms(sg * (1 + mult * _GRID * (1 - sg))),
                                       rel=1e-4)


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
def test_silu_glu_mult_gates_with_sigmoid_of_mult_gate(mult):
    generator = torch.Generator().manual_seed(0)
    u, g = (torch.randn(4096, generator=generator, dtype=torch.float64) for _ in range(2))
    out = U.silu_glu(u, g, mult=mult)  # all three scales tied (to_output_scale)
    scale = _ratio_is_constant(out, u * g * torch.sigmoid(mult * g))
    assert scale == pytest.approx(1 / _normal_rms(_GRID * torch.sigmoid(mult * _GRID)), rel=1e-4)


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
def test_softmax_mult_is_softmax_of_mult_x(mult):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=generator, dtype=torch.float64)
    out = U.softmax(x, dim=-1, mult=mult)
    _ratio_is_constant(out, torch.softmax(mult * x, dim=-1))
    assert out.std().item() == pytest.approx(1.0, abs=0.06)  # the std rule (see the README)


@pytest.mark.parametrize("mult", [0.5, 1.0, 8.0])
def test_attention_mult_scales_the_logits_by_mult_over_head_dim(mult):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 16, generator=generator, dtype=torch.float64)
               for _ in range(3))
    ours = U.scaled_dot_product_attention(q, k, v, is_causal=True, mult=mult)
    reference = torch.softmax(
        (q @ k.transpose(-2, -1) * mult / 16).masked_fill(
            torch.ones(32, 32, dtype=torch.bool).triu(1), -math.inf), dim=-1) @ v
    ratio = ours / reference
    # One positive factor per query row (the unit-scaling row scale), shared by all features.
    torch.testing.assert_close(ratio, ratio[:1, :1, :, :1].expand_as(ratio))
    assert (ratio > 0).all()
    with pytest.raises(ValueError, match="mult"):
        U.scaled_dot_product_attention(q, k, v, mult=2.0, scale=0.25)


def test_cross_entropy_mult_scales_the_logits_in_the_forward_pass_only():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 32, (256,), generator=generator)
    loss = U.cross_entropy(x, target, mult=3.0)
    assert loss.item() == pytest.approx(F.cross_entropy(3.0 * x, target).item(), rel=1e-12)
    loss.backward()
    p_minus_y = torch.softmax(3.0 * x.detach(), -1) - F.one_hot(target, 32)
    _ratio_is_constant(x.grad, p_minus_y)  # no factor 3 on the way back


def test_linear_readout_divides_by_fan_in():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 64, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(48, 64, generator=generator, dtype=torch.float64, requires_grad=True)
    out = U.linear_readout(x, w)
    torch.testing.assert_close(out, x.detach() @ w.detach().T / 64, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    out.backward(grad)
    torch.testing.assert_close(x.grad, grad @ w.detach() / 48**0.5, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, grad.T @ x.detach() / 128**0.5, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- u-μP: learning rates and depth


def _typed_parameters() -> List[nn.Parameter]:
    return [
        uu.Parameter(torch.zeros(256, 16), "weight"),  # an embedding table: fan-in 16
        uu.Parameter(torch.zeros(32, 16), "weight", mup_scaling_depth=4),
        uu.Parameter(torch.zeros(8, 4, 3), "weight", mup_scaling_depth=2),  # a convolution
        uu.Parameter(torch.zeros(32), "bias", mup_scaling_depth=4),
        uu.Parameter(torch.zeros(16), "norm"),
        uu.Parameter(torch.zeros(100, 16), "output"),
    ]


def _documented_scale(param: nn.Parameter, optimizer: str) -> float:
    """unit-scaling's documented learning-rate factors, from the shape alone."""
    depth = 1.0 if param.mup_scaling_depth is None else param.mup_scaling_depth ** -0.5
    fan_in = float(np.prod(param.shape[1:])) if param.dim() > 1 else float(param.shape[0])
    if optimizer == "sgd-output":  # SGD with readout_constraint="to_output_scale"
        return depth * {"weight": fan_in**0.5, "bias": param.shape[0], "norm": param.shape[0],
                        "output": 1.0}[param.mup_type]
    return depth * (fan_in**-0.5 if param.mup_type == "weight" else 1.0)


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd", "sgd-output"])
def test_each_mup_type_gets_the_documented_learning_rate(optimizer):
    params = _typed_parameters()
    lr, decay = 0.5, 1e-3
    make = {"adam": lambda: uu.optim.Adam(params, lr=lr, weight_decay=decay),
            "adamw": lambda: uu.optim.AdamW(params, lr=lr, weight_decay=decay),
            "sgd": lambda: uu.optim.SGD(params, lr=lr, weight_decay=decay),
            "sgd-output": lambda: uu.optim.SGD(params, lr=lr, weight_decay=decay,
                                               readout_constraint="to_output_scale")}[optimizer]
    groups = make().param_groups
    assert len(groups) == len(params)
    for param, group in zip(params, groups):
        (member,) = group["params"]
        assert member is param
        expected = lr * _documented_scale(param, optimizer)
        assert group["lr"] == pytest.approx(expected, rel=1e-12), param.mup_type
        # Independent weight decay: a step decays by `decay`, whatever the group's rate.
        assert group["weight_decay"] * group["lr"] == pytest.approx(decay, rel=1e-12)


def test_non_mup_parameters_are_refused_unless_allowed():
    with pytest.raises(ValueError, match="mup_type"):
        uu.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=0.1)
    groups = uu.optim.scaled_parameters([nn.Parameter(torch.zeros(3))],
                                        uu.optim.lr_scale_func_adam, lr=0.1,
                                        allow_non_unit_scaling_params=True)
    assert groups[0]["lr"] == 0.1


def test_set_learning_rate_rescales_every_mup_group():
    optimizer = uu.optim.AdamW(_typed_parameters(), lr=0.5)
    uu.optim.set_learning_rate(optimizer, 0.25)
    for group in optimizer.param_groups:
        (param,) = group["params"]
        assert group["lr"] == pytest.approx(0.25 * _documented_scale(param, "adam"), rel=1e-12)


def test_depth_containers_record_their_length_on_every_parameter():
    stack = uu.DepthSequential(*(uu.Linear(8, 8, bias=True) for _ in range(3)))
    assert {p.mup_scaling_depth for p in stack.parameters()} == {3}
    blocks = uu.DepthModuleList([uu.MLP(8) for _ in range(5)])
    assert {p.mup_scaling_depth for p in blocks.parameters()} == {5}
    with pytest.raises(ValueError, match="u-μP parameter"):
        uu.DepthSequential(nn.Linear(8, 8))
    with pytest.raises(ValueError, match="already belongs"):
        uu.DepthSequential(stack)


@pytest.mark.parametrize("residual_mult, residual_attn_ratio, layers",
                         [(1.0, 1.0, 4), (0.5, 1.0, 3), (1.0, 2.0, 4), (2.0, 0.5, 6)])
def test_residual_rule_gives_documented_variance_shares(residual_mult, residual_attn_ratio,
                                                        layers):
    """Appendix G of the u-μP paper: every attention branch weighs the same, every MLP branch
    the same; their average against the embedding is residual_mult**2, attention against MLP
    residual_attn_ratio**2. Checked by joining unit branches as `residual_add` does."""
    rule = uu.transformer_residual_scaling_rule(residual_mult, residual_attn_ratio)
    weights = [1.0]  # the variance each contribution keeps in the stream (embedding first)
    for index in range(2 * layers):
        tau = rule(index, 2 * layers)
        weights = [w / (1 + tau**2) for w in weights] + [tau**2 / (1 + tau**2)]
    embedding, attention, mlp = weights[0], weights[1::2], weights[2::2]
    assert sum(weights) == pytest.approx(1.0, rel=1e-12)
    assert max(attention) == pytest.approx(min(attention), rel=1e-12)
    assert max(mlp) == pytest.approx(min(mlp), rel=1e-12)
    assert (sum(attention) + sum(mlp)) / 2 / embedding == pytest.approx(residual_mult**2,
                                                                          rel=1e-12)
    assert sum(attention) / sum(mlp) == pytest.approx(residual_attn_ratio**2, rel=1e-12)
    stack = uu.TransformerStack(layers, rule, hidden_size=8, heads=2, is_causal=True)
    taus = [t for layer in stack for t in (layer.mhsa_tau, layer.mlp_tau)]
    assert taus == [rule(i, 2 * layers) for i in range(2 * layers)]


def test_mup_fields_survive_copies_pickles_and_state_dicts():
    model = uu.DepthSequential(uu.Linear(4, 4, bias=True), uu.LayerNorm(4, elementwise_affine=True))
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert [(p.mup_type, p.mup_scaling_depth) for p in copied.parameters()] == [
            ("weight", 2), ("bias", 2), ("norm", 2), ("bias", 2)]
    fresh = uu.DepthSequential(uu.Linear(4, 4, bias=True),
                               uu.LayerNorm(4, elementwise_affine=True))
    fresh.load_state_dict(model.state_dict())
    assert all(p.mup_scaling_depth == 2 for p in fresh.parameters())


# ---------------------------------------------------------------- kept differences (README)


def test_softmax_keeps_the_std_rule_measured_against_the_library_rule():
    """README, "Coming from unit-scaling": the output std is unit here, 0.57 by the library's
    interpolated scale (n over its square root, at mult 1)."""
    n = 4096
    x = torch.randn(8, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = U.softmax(x, -1, constraint=None)
    alpha = 1 / (1 + 4)  # the library's sigmoid(log(mult**2 / 4)) at mult 1
    library = torch.softmax(x, -1) * math.exp((1 - alpha) * math.log(n) + alpha * math.log(n**0.5))
    assert ours.std().item() == pytest.approx(1.0, abs=0.03)
    assert library.std().item() == pytest.approx(0.57, abs=0.03)


def test_broadcast_matmul_counts_the_copies():
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(16, 64, 128, generator=generator, requires_grad=True)
    right = torch.randn(128, 32, generator=generator, requires_grad=True)
    out = U.matmul(left, right, constraint=None)
    out.backward(torch.randn(out.shape, generator=generator))
    assert right.grad.std().item() == pytest.approx(1.0, abs=0.05)  # 4.0 without the 16 copies


def test_dropout_in_eval_mode_is_the_identity():
    x = torch.randn(1000)
    assert torch.equal(U.dropout(x, 0.3, training=False), x)


def test_embedding_max_norm_renormalises_as_torch_does():
    weight = torch.randn(10, 4) * 3
    reference = weight.clone()
    ids = torch.tensor([1, 2, 2, 7])
    out = U.embedding(ids, weight, max_norm=1.0)
    torch.testing.assert_close(out, F.embedding(ids, reference, max_norm=1.0))
    torch.testing.assert_close(weight, reference)  # both renormalised the rows in place


# ---------------------------------------------------------------- transforms


def test_unit_scale_replace_traces_a_function_as_its_replacement():
    def my_gelu(x: Tensor) -> Tensor:  # a hand-written tanh GELU, as models often carry
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

        def forward(self, x: Tensor) -> Tensor:
            return self.down(my_gelu(self.up(x)))

    model = Block()
    converted = transforms.unit_scale(model, replace={my_gelu: F.gelu})
    assert type(converted) is Block  # the model's own object, its forward converted
    graph = converted.forward.graph
    targets = {getattr(n.target, "__name__", n.target) for n in graph.nodes}
    assert "unit_gelu" in targets and "tanh" not in targets
    assert Block.forward.__closure__[0].cell_contents is my_gelu  # restored after tracing
    x = torch.randn(64, 32)
    assert converted(x).std().item() == pytest.approx(1.0, abs=0.2)


@needs_dynamo
def test_unit_scale_comes_before_graph_transforms_applied_earlier():
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    fp8_then_unit = transforms.unit_scale(transforms.simulate_fp8(model))
    unit = transforms.unit_scale(model)
    x = torch.randn(32, 64)
    assert transforms.compose.transforms_of(fp8_then_unit)  # the FP8 transform is kept
    cast, exact = fp8_then_unit(x), unit(x)
    relative = ((cast - exact).norm() / exact.norm()).item()
    assert 1e-3 < relative < 0.15


def test_label_smoothing_is_refused_by_the_op_and_kept_by_unit_scale():
    logits, target = torch.randn(64, 10), torch.randint(0, 10, (64,))
    with pytest.raises(ValueError, match="label_smoothing"):
        U.cross_entropy(logits, target, label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        uu.CrossEntropyLoss(label_smoothing=0.1)
    converted = transforms.unit_scale(nn.CrossEntropyLoss(label_smoothing=0.1))
    assert isinstance(converted, uu.CrossEntropyLoss)
    torch.testing.assert_close(converted(logits, target),
                               F.cross_entropy(logits, target, label_smoothing=0.1))


@needs_dynamo
def test_simulate_format_casts_the_unscaled_inputs_of_a_unit_scaled_linear():
    """As unit-scaling casts them: the weight and input, not the weight times its scale."""
    torch.manual_seed(0)
    layer = uu.Linear(256, 64, constraint=None)
    nearest_e4m3 = uu.formats.FPFormat(4, 3, rounding="nearest")
    cast = transforms.simulate_format(layer, nearest_e4m3, uu.formats.FPFormat(5, 2))
    x = torch.randn(32, 256)
    expected = U.linear(nearest_e4m3.quantise(x), nearest_e4m3.quantise(layer.weight.detach()),
                        constraint=None)
    torch.testing.assert_close(cast(x), expected, rtol=1e-6, atol=1e-6)

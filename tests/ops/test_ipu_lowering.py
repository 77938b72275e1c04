"""The lowering table (what PopTorch lowers each ATen op to) and the emulator's following it:
GELU as PopART computes it, unit-scaling constants of the GELU that runs, and FP16 casts with
stochastic rounding."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Callable, Dict, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT as REPO
from torch import nn

import ipu_unit_scaling.functional as U
from ipu_standins.poptorch import _lowering as lowering
from ipu_standins.poptorch._lowering import stochastic_round_to_half
from ipu_standins.poptorch._lowering_table import GELU_LOWERING, LOWERINGS, POPTORCH_COMMIT
from ipu_unit_scaling.ipu import trace_like_poptorch
from ipu_unit_scaling.ops import activation_ops
from ipu_unit_scaling.ops import ipu_lowering as package_lowering
from ipu_unit_scaling.ops.ipu_lowering import torch_numerics
from ipu_unit_scaling.training.precision import round_to_half

pytestmark = pytest.mark.numerics

def _generator_script():
    # scripts/ is not a package: load the table's generator by path.
    spec = importlib.util.spec_from_file_location(
        "poptorch_lowering_script", REPO / "scripts" / "poptorch_lowering.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _generator_script()


# ---------------------------------------------------------------- independent float64 formulas

_A = math.sqrt(2.0 / math.pi)
_B = 0.044715


def tanh_gelu64(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(_A * (x + _B * x**3)))


def popnn_gelu_gradient64(x: np.ndarray) -> np.ndarray:
    """popnn's GELU gradient (what PopART's GeluGrad computes), in float64."""
    return 0.5 * (1.0 + np.tanh(_A * (x + _B * x**3)) + _A * x * np.exp(-x * x / 2.0))


def erf_gelu64(x: np.ndarray) -> np.ndarray:
    return x * 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def erf_gelu_gradient64(x: np.ndarray) -> np.ndarray:
    pdf = np.exp(-x * x / 2.0) / math.sqrt(2.0 * math.pi)
    return 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))) + x * pdf


def tanh_gelu_gradient64(x: np.ndarray) -> np.ndarray:
    t = np.tanh(_A * (x + _B * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _A * (1.0 + 3.0 * _B * x * x)


def normal_moments(f: Callable[[np.ndarray], np.ndarray]) -> Tuple[float, float]:
    """(std, rms) of f(z) for z ~ N(0, 1): Simpson's rule on [-12, 12], float64."""
    z = np.linspace(-12.0, 12.0, 48001)
    weights = np.ones_like(z)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    weights *= (z[1] - z[0]) / 3.0 * np.exp(-z * z / 2.0) / math.sqrt(2.0 * math.pi)
    values = f(z)
    mean, mean_square = float(weights @ values), float(weights @ values**2)
    return math.sqrt(mean_square - mean**2), math.sqrt(mean_square)


class Call(nn.Module):
    """A function of one parameter, so that traces give its gradient."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
        super().__init__()
        self.fn = fn
        self.x = nn.Parameter(x.clone())

    def forward(self) -> torch.Tensor:
        return self.fn(self.x)


def _value_and_gradient(module: nn.Module, run: Callable[[], torch.Tensor],
                        upstream: torch.Tensor) -> Tuple[np.ndarray, np.ndarray]:
    module.zero_grad(set_to_none=True)
    out = run()
    out.backward(upstream)
    return out.detach().double().numpy(), module.x.grad.double().numpy()


# ---------------------------------------------------------------- the table


def test_table_names_its_poptorch_commit_and_a_known_verdict_per_row(script):
    assert len(POPTORCH_COMMIT) == 40 and int(POPTORCH_COMMIT, 16) >= 0
    table = REPO / "ipu_standins" / "poptorch" / "_lowering_table.py"
    assert POPTORCH_COMMIT in table.read_text()
    for op, row in LOWERINGS.items():
        assert row.verdict in script.VERDICTS, op
        assert ".cpp:" in row.handler, op
    assert set(GELU_LOWERING) == {"none", "tanh"}


def test_table_rows_are_the_generator_reviews(script):
    """The checked-in table is what the generator writes from its reviews: same ops, verdicts
    and notes (regenerating needs a poptorch checkout; this catches a hand edit of either)."""
    assert set(LOWERINGS) == set(script.REVIEWS)
    for op, row in LOWERINGS.items():
        review = script.REVIEWS[op]
        assert (row.verdict, row.note) == (review.verdict, review.note), op


def test_every_op_the_project_models_trace_to_has_a_row(script):
    """The example GPT (plain, unit, u-μP; every precision; dropout on and off) and the
    BERT-style encoder in every regime, as PopTorch sees them."""
    missing: Dict[str, str] = {}
    for name, module, inputs in script.project_models(hugging_face=False):
        for op in script.ops_poptorch_sees(module, *inputs) - set(LOWERINGS):
            missing.setdefault(op, name)
    assert not missing, missing


def test_every_op_the_converted_hugging_face_models_trace_to_has_a_row(script):
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        pytest.skip(f"transformers {transformers.__version__} has no PyTorch models here")
    from ipu_unit_scaling.transforms.export import export_unavailable

    if export_unavailable() is not None:
        pytest.skip(export_unavailable())
    seen = set()
    for _, module, inputs in script.hugging_face_models():
        seen |= script.ops_poptorch_sees(module, *inputs)
    assert {"silu", "rsqrt", "cos", "sin"} <= seen  # Llama's MLP, norm and rotary embedding
    assert seen <= set(LOWERINGS), seen - set(LOWERINGS)


def test_ops_poptorch_sees_takes_dropout_whole_and_in_place_ops_as_out_of_place(script):
    module = Call(lambda x: F.dropout(x, 0.5, training=True).mul_(2.0), torch.randn(4, 4))
    assert script.ops_poptorch_sees(module) == {"dropout", "mul"}


def test_rows_that_change_numbers_are_the_rows_the_emulator_rewrites():
    changing = {op for op, row in LOWERINGS.items()
                if row.verdict in ("differs", "stochastic-rounding")}
    assert changing == lowering.REWRITTEN_OPS


# ---------------------------------------------------------------- the generator on a small tree

_FAKE_ACTIVATIONS = """
namespace poptorch {
torch::jit::Node *geluHandler(torch::jit::Graph *graph, torch::jit::Node *node) {
  const auto approximate = constantToString(node->input(1)->node());
  if (approximate == "tanh") {
    return createGelu(graph, {node->input(0)});
  }
  if (approximate == "none") {
    return %s(graph, {node->input(0)});  // which PopART op
  }
  ERROR("unknown");
}
static void registration() {
  registerHandler(c10::aten::gelu, geluHandler);
  registerHandler(c10::aten::silu, siluHandler);
}
torch::jit::Node *siluHandler(torch::jit::Graph *graph, torch::jit::Node *node) {
  return createSwish(graph, {node->input(0)});
}
}
"""


def _fake_checkout(root: Path, none_builder: str) -> Path:
    folder = root / "poptorch" / "source" / "popart_canonicalization"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ActivationOps.cpp").write_text(_FAKE_ACTIVATIONS % none_builder)
    return root


def test_generator_reads_handlers_builders_and_gelu_branches(script, tmp_path):
    root = _fake_checkout(tmp_path, "createGelu")
    handlers = script.registered_handlers(root)
    assert {op: h.name for op, h in handlers.items()} == {"gelu": "geluHandler",
                                                         "silu": "siluHandler"}
    assert script.gelu_lowering(handlers["gelu"]) == {"none": "Gelu", "tanh": "Gelu"}
    reviews = {op: script.Review("same", "note", script.body_hash(h.body))
               for op, h in handlers.items()}
    rows = script.lowering_rows(root, ["gelu", "silu"], reviews)
    assert [(r.op, r.handler, r.popart) for r in rows] == [
        ("gelu", "ActivationOps.cpp:geluHandler", ("createGelu",)),
        ("silu", "ActivationOps.cpp:siluHandler", ("createSwish",))]
    text = script.render(rows, {"none": "Gelu", "tanh": "Gelu"}, "f" * 40)
    namespace: Dict[str, object] = {}
    exec(compile(text, "poptorch_lowering.py", "exec"), namespace)
    assert namespace["LOWERINGS"]["silu"].popart == ("createSwish",)  # type: ignore[index]

    # A newer poptorch that builds GeluErf for approximate='none': the branch is read anew,
    # and the changed handler must be reviewed again before a table is written.
    _fake_checkout(tmp_path, "createGeluErf")
    handlers = script.registered_handlers(root)
    assert script.gelu_lowering(handlers["gelu"]) == {"none": "GeluErf", "tanh": "Gelu"}
    with pytest.raises(SystemExit, match="geluHandler changed since it was reviewed"):
        script.lowering_rows(root, ["gelu"], reviews)
    with pytest.raises(SystemExit, match="relu: no handler found"):
        script.lowering_rows(root, ["relu"], reviews)
    with pytest.raises(SystemExit, match="silu: not reviewed"):
        script.lowering_rows(root, ["silu"], {})


# ---------------------------------------------------------------- rows that differ from eager


def _gelu_module(approximate: str) -> Callable[[torch.Tensor], nn.Module]:
    return lambda x: Call(lambda t: F.gelu(t, approximate=approximate), x)


# op -> (tiny modules using it, float64 value and gradient of what PopART computes)
DIFFERING = {
    "gelu": ([_gelu_module("none"), _gelu_module("tanh")], tanh_gelu64, popnn_gelu_gradient64),
}


def test_every_row_that_differs_from_eager_has_a_case_here():
    assert set(DIFFERING) == {op for op, row in LOWERINGS.items() if row.verdict == "differs"}


@pytest.mark.parametrize("op", sorted(DIFFERING))
def test_traced_op_computes_what_popart_computes(op):
    """Through trace_like_poptorch each op whose lowering differs computes the lowered
    function and its PopART gradient, checked against float64 closed forms."""
    builders, value64, gradient64 = DIFFERING[op]
    x = torch.linspace(-6.0, 6.0, 241)
    upstream = torch.linspace(-1.0, 2.0, 241)
    for build in builders:
        module = build(x)
        trace = trace_like_poptorch(module)
        value, gradient = _value_and_gradient(module, trace, upstream)
        x64 = x.double().numpy()
        np.testing.assert_allclose(value, value64(x64), rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(gradient, upstream.double().numpy() * gradient64(x64),
                                   rtol=2e-6, atol=2e-6)


def test_gelu_lowering_differs_from_eager_and_torch_numerics_keeps_eager():
    x = torch.linspace(-4.0, 4.0, 161)
    upstream = torch.ones(161)
    for approximate in ("none", "tanh"):
        module = _gelu_module(approximate)(x)
        eager = _value_and_gradient(module, module, upstream)
        ipu = _value_and_gradient(module, trace_like_poptorch(module), upstream)
        with torch_numerics():
            as_torch = _value_and_gradient(module, trace_like_poptorch(module), upstream)
        np.testing.assert_allclose(as_torch[0], eager[0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(as_torch[1], eager[1], rtol=1e-6, atol=1e-7)
        # PopART's gradient departs from both of torch's by up to 8e-4 (tanh) and 2e-4 (erf).
        assert np.abs(ipu[1] - eager[1]).max() > 1e-4, approximate
    assert np.abs(ipu[0] - eager[0]).max() < 1e-6  # tanh: the same forward


# ---------------------------------------------------------------- GELU's unit-scaling constants


def test_gelu_moments_match_independent_quadrature():
    """U's Gauss-Hermite moments of each GELU form against Simpson's rule of closed forms."""
    expected = {
        "none": (normal_moments(erf_gelu64)[0], normal_moments(erf_gelu_gradient64)[1]),
        "tanh": (normal_moments(tanh_gelu64)[0], normal_moments(tanh_gelu_gradient64)[1]),
        "popart": (normal_moments(tanh_gelu64)[0], normal_moments(popnn_gelu_gradient64)[1]),
    }
    for form, (std, rms) in expected.items():
        assert activation_ops.GELU_STDS[form] == pytest.approx((std, rms), rel=1e-9), form
    # The forms differ in the fifth digit: a test at 1e-9 tells them apart.
    assert abs(expected["popart"][1] / expected["none"][1] - 1) > 5e-5


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_unit_scaled_gelu_has_unit_constants_of_the_gelu_that_runs(approximate):
    """constraint=None: output scale 1/std and grad scale 1/rms of the gradient, for z ~ N(0, 1).
    Eager runs torch's GELU, the emulator PopART's, each with its own constants."""
    x = torch.linspace(-5.0, 5.0, 201)
    upstream = torch.linspace(2.0, -1.0, 201)
    x64, up64 = x.double().numpy(), upstream.double().numpy()
    module = Call(lambda t: U.gelu(t, approximate=approximate, constraint=None), x)

    value, gradient = _value_and_gradient(module, trace_like_poptorch(module), upstream)
    std, _ = normal_moments(tanh_gelu64)
    _, rms = normal_moments(popnn_gelu_gradient64)
    np.testing.assert_allclose(value, tanh_gelu64(x64) / std, rtol=3e-6, atol=3e-6)
    np.testing.assert_allclose(gradient, up64 * popnn_gelu_gradient64(x64) / rms,
                               rtol=3e-6, atol=3e-6)

    value, gradient = _value_and_gradient(module, module, upstream)
    forward, slope = ((erf_gelu64, erf_gelu_gradient64) if approximate == "none"
                      else (tanh_gelu64, tanh_gelu_gradient64))
    np.testing.assert_allclose(value, forward(x64) / normal_moments(forward)[0],
                               rtol=3e-6, atol=3e-6)
    np.testing.assert_allclose(gradient, up64 * slope(x64) / normal_moments(slope)[1],
                               rtol=3e-6, atol=3e-6)


def test_umup_gelu_has_the_constants_of_the_gelu_that_runs():
    from ipu_unit_scaling.parametrization.umup import ScaledGELU

    mult = 0.5
    x = torch.linspace(-5.0, 5.0, 201)
    upstream = torch.linspace(2.0, -1.0, 201)
    x64, up64 = x.double().numpy(), upstream.double().numpy()
    module = Call(ScaledGELU(mult, constraint=None), x)
    value, gradient = _value_and_gradient(module, trace_like_poptorch(module), upstream)
    std, _ = normal_moments(lambda z: tanh_gelu64(mult * z))
    _, rms = normal_moments(lambda z: mult * popnn_gelu_gradient64(mult * z))
    np.testing.assert_allclose(value, tanh_gelu64(mult * x64) / std, rtol=3e-6, atol=3e-6)
    np.testing.assert_allclose(gradient, up64 * mult * popnn_gelu_gradient64(mult * x64) / rms,
                               rtol=3e-6, atol=3e-6)
    value, _ = _value_and_gradient(module, module, upstream)
    np.testing.assert_allclose(
        value, erf_gelu64(mult * x64) / normal_moments(lambda z: erf_gelu64(mult * z))[0],
        rtol=3e-6, atol=3e-6)


# ---------------------------------------------------------------- FP16 with stochastic rounding


def _half_neighbours(value: float) -> Tuple[float, float]:
    """The float16 values below and above ``value`` (float64), by numpy; inf above 65504 counts
    as 65536."""
    nearest = np.float16(value)
    below = nearest if float(nearest) <= value else np.nextafter(nearest, np.float16(-np.inf))
    if below == np.finfo(np.float16).max:
        return float(below), 65536.0
    return float(below), float(np.nextafter(below, np.float16(np.inf)))


# Normal, subnormal, below the smallest subnormal, negative, and between 65504 and 65536.
SR_VALUES = [1.0001, 3.14159265, -2.71828182, 7.3e-6, 2.0e-8, -1234.567, 65519.0]


@pytest.mark.parametrize("value", SR_VALUES)
def test_stochastic_rounding_lands_on_the_two_neighbours_and_is_unbiased(value):
    draws = 40000
    x = torch.full((draws,), value, dtype=torch.float32)
    exact = float(x[0])  # the float32 value being rounded
    rounded = stochastic_round_to_half(x, torch.Generator().manual_seed(1))
    assert rounded.dtype == torch.float16
    below, above = _half_neighbours(abs(exact))
    sign = -1.0 if exact < 0 else 1.0
    landing = {sign * below, sign * (math.inf if above == 65536.0 else above)}
    values = rounded.double()
    assert set(values.tolist()) == landing  # both neighbours, nothing else
    # The mean magnitude, with inf counted as 65536, is |value| within 5 standard errors.
    magnitudes = torch.where(values.isinf(), torch.full_like(values, 65536.0), values.abs())
    p = (abs(exact) - below) / (above - below)
    standard_error = (above - below) * math.sqrt(p * (1 - p) / draws)
    assert abs(magnitudes.mean().item() - abs(exact)) < 5 * standard_error


def test_stochastic_rounding_keeps_what_half_holds():
    held = torch.tensor([0.0, -0.0, 1.0, -65504.0, 2.0**-24, float("inf"), -float("inf")])
    rounded = stochastic_round_to_half(held, torch.Generator().manual_seed(0))
    assert torch.equal(rounded, held.half())
    assert torch.equal(torch.signbit(rounded), torch.signbit(held))
    assert torch.isnan(stochastic_round_to_half(torch.tensor([float("nan")]))).all()
    assert torch.equal(stochastic_round_to_half(torch.tensor([1e6, -7e4])),
                       torch.tensor([float("inf"), -float("inf")]).half())
    with pytest.raises(TypeError, match="float32 or float64"):
        stochastic_round_to_half(torch.ones(2, dtype=torch.float16))


def test_emulator_rounds_both_fp16_casts_stochastically_when_asked():
    """round_to_half's forward cast, and the cast of its gradient, as an IPU rounds them under
    ipu.stochastic_rounding: each lands on a neighbour, unbiased; without it, to nearest."""
    value, upstream_value, draws = 1.0001, 2.71828182, 40000
    module = Call(round_to_half, torch.full((draws,), value))
    upstream = torch.full((draws,), upstream_value)
    nearest = _value_and_gradient(module, trace_like_poptorch(module), upstream)
    assert set(nearest[0].tolist()) == {float(np.float16(value))}
    assert set(nearest[1].tolist()) == {float(np.float16(upstream_value))}

    torch.manual_seed(3)
    trace = trace_like_poptorch(module, stochastic_rounding=True)
    rounded, gradient = _value_and_gradient(module, trace, upstream)
    for result, original in ((rounded, value), (gradient, upstream_value)):
        exact = float(np.float32(original))
        below, above = _half_neighbours(exact)
        assert set(result.tolist()) == {below, above}
        p = (exact - below) / (above - below)
        assert abs(result.mean() - exact) < 5 * (above - below) * math.sqrt(p * (1 - p) / draws)


def test_emulator_backend_passes_the_stochastic_rounding_option():
    # The emulator backend is the IPU backend on the PopTorch stand-in: the config's
    # ipu.stochastic_rounding reaches Precision.enableStochasticRounding, which the stand-in
    # applies when it compiles.
    from ipu_unit_scaling.backends import build_training_model, make_optimizer
    from ipu_unit_scaling.training.precision import build_model
    from ipu_unit_scaling.training.run_config import load_config

    for rounding in (False, True):
        config = load_config("tiny", ["precision.dtype=fp16",
                                      f"ipu.stochastic_rounding={str(rounding).lower()}"])
        torch.manual_seed(0)
        model = build_model(config)
        wrapper = build_training_model(model, make_optimizer(model, config, backend="emulator"),
                                       config, backend="emulator")
        assert wrapper.options._Popart.options["enableStochasticRounding"] is rounding
        ids = torch.randint(0, config.model.vocab_size, (config.samples_per_call, 9))
        wrapper(ids[:, :-1], ids[:, 1:])
        graph = wrapper.executor._graph.trace.graph  # what the stand-in compiled
        casts = [n for n in graph.graph.nodes if n.target is lowering.stochastic_cast]
        assert bool(casts) == rounding
        wrapper.destroy()


def test_the_packages_gelu_on_ipu_is_the_standins_lowering():
    """``U.gelu``'s PopTorch form takes the constants of the GELU the stand-in's table (from
    poptorch's source) lowers to, with the gradient the stand-in computes (element-wise: the
    same values bit for bit)."""
    forms = {"Gelu": "popart", "GeluErf": "none"}
    assert package_lowering.GELU_ON_IPU == {k: forms[v] for k, v in GELU_LOWERING.items()}
    x = torch.linspace(-14.0, 14.0, 4001, dtype=torch.float64)
    for dtype in (torch.float16, torch.float32, torch.float64):
        assert torch.equal(package_lowering.popart_gelu_slope(x.to(dtype)),
                           lowering.popart_gelu_slope(x.to(dtype)))

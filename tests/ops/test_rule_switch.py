"""``uu.rules("unit-scaling")``: under the switch every kept rule takes unit-scaling 0.3.5's
formula; outside it, this package's rules hold again.

Each op is checked in float64 against the library's documented formula written out here, on
its own (no code of the package's rule module): the output and every input gradient for one
random output gradient. No library is needed (tests/test_unit_scaling_side_by_side.py runs
the library itself when it is given).
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Dict, List, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import ipu_unit_scaling as uu
import ipu_unit_scaling.functional as U

pytestmark = pytest.mark.numerics

LIBRARY = "unit-scaling"
# Float64 unit roundoff times a bound on the roundings between the inputs and one compared
# value: a dot product of at most 64 terms, an exp and a log in an interpolated scale, and the
# op's own few multiplies each way stay below 1024.
TOLERANCE = 2.0**-53 * 1024


def _interpolate(alpha: float, lower: float, upper: float) -> float:
    # The library's logarithmic interpolation: lower at alpha 0, upper at 1.
    return lower ** (1 - alpha) * upper**alpha


def _leaves(generator: torch.Generator, shapes: Dict[str, Sequence[int]]) -> Dict[str, Tensor]:
    return {name: torch.randn(*shape, generator=generator, dtype=torch.float64)
            .requires_grad_() for name, shape in shapes.items()}


def _grads(output: Tensor, leaves: Dict[str, Tensor], seed: int = 1) -> List[Tensor]:
    grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=output.dtype)
    return [output.detach()] + list(torch.autograd.grad(output, list(leaves.values()), grad))


def _close(ours: Sequence[Tensor], expected: Sequence[Tensor]) -> None:
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected):
        assert got.shape == want.shape
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= TOLERANCE * max(scale, 1e-300), (got, want)


def _check(shapes: Dict[str, Sequence[int]], op: Callable[..., Tensor],
           library_formula: Callable[..., Tensor], seed: int = 0,
           shared: bool = False) -> None:
    """op under the switch, against the formula built from torch ops; and op outside the
    switch must then give something else (the rule really changed and really came back),
    or, for a ``shared`` rule (this package's own is the library's), the same."""
    leaves = _leaves(torch.Generator().manual_seed(seed), shapes)
    with uu.rules(LIBRARY):
        switched = _grads(op(**leaves), leaves)
    expected = _grads(library_formula(**leaves), leaves)
    _close(switched, expected)
    ours = _grads(op(**leaves), leaves)
    if shared:
        _close(ours, expected)
    else:
        assert max((a - b).abs().max().item() for a, b in zip(ours, expected)) > 1e3 * TOLERANCE


def _scale(x: Tensor, forward: float, backward: float) -> Tensor:
    """x times `forward` in the forward pass, its gradient times `backward` (built here from
    detach, not from the package's primitive)."""
    return (x * forward).detach() + x * backward - (x * backward).detach()


@pytest.mark.parametrize("mult", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("constraint", ["to_output_scale", None])
def test_gelu_and_silu_follow_the_library(mult: float, constraint) -> None:
    alpha = 1 / (1 + 0.25 / mult**2)
    output_scale = _interpolate(alpha, 2, (2 / (1 - 1 / math.pi)) ** 0.5)
    for op, grad_alpha, function in [
            ("gelu", alpha, lambda x: F.gelu(x * mult) / mult),
            ("silu", 1 / (1 + 1 / mult**2), lambda x: x * torch.sigmoid(x * mult))]:
        grad_scale = _interpolate(grad_alpha, 2, 2**0.5)
        if constraint == "to_output_scale":
            grad_scale = output_scale
        _check({"x": (16, 64)},
               lambda x, o=op: getattr(U, o)(x, mult=mult, constraint=constraint),
               lambda x, f=function, g=grad_scale: _scale(f(_scale(x, 1, g)), output_scale, 1))


@pytest.mark.parametrize("mult", [0.5, 1.0, 3.0])
def test_silu_glu_follows_the_library(mult: float) -> None:
    scale = _interpolate(1 / (1 + 1 / mult**2), 2, 2**0.5)
    _check({"x": (16, 64), "gate": (16, 64)}, lambda x, gate: U.silu_glu(x, gate, mult=mult),
           lambda x, gate: _scale(_scale(x, 1, scale) * _scale(gate, 1, scale)
                                  * torch.sigmoid(mult * _scale(gate, 1, scale)), scale, 1))


@pytest.mark.parametrize("n,mult", [(16, 1.0), (256, 0.25), (256, 4.0)])
def test_softmax_follows_the_library(n: int, mult: float) -> None:
    alpha = 1 / (1 + 4 / mult**2)
    output_scale = _interpolate(alpha, n, n**0.5)
    grad_scale = _interpolate(alpha, n / mult, (n / mult) ** 0.5)
    _check({"x": (8, n)}, lambda x: U.softmax(x, -1, constraint=None, mult=mult),
           lambda x: _scale(torch.softmax(mult * _scale(x, 1, grad_scale), -1), output_scale, 1))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mult", [1.0, 8.0])
def test_attention_follows_the_library(causal: bool, mult: float) -> None:
    keys, head = 24, 16
    spread = _interpolate(1 / (1 + 4 * head / mult**2),
                          ((math.log(keys) if causal else 1.0) / keys) ** 0.5, 1.0)
    scale = 1 / spread

    def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        logits = q @ k.transpose(-2, -1) * (mult / head)
        if causal:
            hidden = torch.ones(keys, keys, dtype=torch.bool).triu(1)
            logits = logits.masked_fill(hidden, -math.inf)
        return torch.softmax(logits, -1) @ v

    shapes = {name: (2, 3, keys, head) for name in ("q", "k", "v")}
    _check(shapes, lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                   mult=mult),
           lambda q, k, v: _scale(attention(*(_scale(t, 1, scale) for t in (q, k, v))),
                                  scale, 1))


@pytest.mark.parametrize("classes", [10, 50])
def test_cross_entropy_follows_the_library(classes: int) -> None:
    rows = 32
    target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(3))
    target[::4] = -100  # ignored targets: the library still divides by every row
    grad_scale = classes / (classes - 1) ** 0.5
    _check({"x": (rows, classes)}, lambda x: U.cross_entropy(x, target),
           lambda x: _scale(F.cross_entropy(_scale(x, 1, grad_scale), target, reduction="sum"),
                            1 / rows, 1))
    _check({"x": (rows, classes)}, lambda x: uu.CrossEntropyLoss()(x, target),
           lambda x: _scale(F.cross_entropy(_scale(x, 1, grad_scale), target, reduction="sum"),
                            1 / rows, 1))


def test_dropout_in_eval_mode_follows_the_library() -> None:
    keep = (1 - 0.2) ** 0.5
    _check({"x": (8, 32)}, lambda x: U.dropout(x, 0.2, training=False),
           lambda x: _scale(_scale(x, 1, keep), keep, 1))
    _check({"x": (8, 32)}, lambda x: uu.Dropout(0.2).eval()(x),
           lambda x: _scale(_scale(x, 1, keep), keep, 1))


@pytest.mark.parametrize("constraint", ["to_output_scale", None, "gmean"])
def test_linear_and_conv1d_add_the_bias_times_the_output_scale_as_the_library(constraint
                                                                               ) -> None:
    # This package's rule is the library's, with or without the switch: a bias times the output
    # scale moves the output at the pace the weights do (docs/results/nanogpt-demo).
    rows, fan_in, fan_out = 40, 24, 12
    output_scale, grad_scale = fan_in**-0.5, fan_out**-0.5
    if constraint == "to_output_scale":
        grad_scale = output_scale
    elif constraint == "gmean":
        output_scale = grad_scale = (output_scale * grad_scale) ** 0.5
    weight_scale = rows**-0.5
    _check({"x": (rows, fan_in), "weight": (fan_out, fan_in), "bias": (fan_out,)},
           lambda x, weight, bias: U.linear(x, weight, bias, constraint=constraint),
           lambda x, weight, bias: _scale(
               _scale(x, 1, grad_scale) @ _scale(weight, 1, weight_scale).T
               + _scale(bias, 1, weight_scale), output_scale, 1), shared=True)
    # conv1d: 4 sequences of 10, kernel 3, padding 1: 40 output positions.
    kernel = 3
    output_scale, grad_scale = (fan_in * kernel) ** -0.5, (1 / (fan_out * kernel)) ** 0.5
    if constraint == "to_output_scale":
        grad_scale = output_scale
    elif constraint == "gmean":
        output_scale = grad_scale = (output_scale * grad_scale) ** 0.5
    _check({"x": (4, fan_in, 10), "weight": (fan_out, fan_in, kernel), "bias": (fan_out,)},
           lambda x, weight, bias: U.conv1d(x, weight, bias, padding=1, constraint=constraint),
           lambda x, weight, bias: _scale(F.conv1d(
               _scale(x, 1, grad_scale), _scale(weight, 1, weight_scale),
               _scale(bias, 1, weight_scale), padding=1), output_scale, 1), shared=True)


def test_broadcast_matmul_and_add_follow_the_library() -> None:
    batch, rows, inner, columns = 6, 8, 16, 12
    _check({"left": (batch, rows, inner), "right": (inner, columns)},
           lambda left, right: U.matmul(left, right, constraint=None),
           lambda left, right: _scale(_scale(left, 1, columns**-0.5)
                                      @ _scale(right, 1, rows**-0.5), inner**-0.5, 1))
    # add under to_output_scale: every scale is the output's, 1/sqrt(2), broadcast or not.
    _check({"x": (8, 32), "y": (32,)}, lambda x, y: U.add(x, y),
           lambda x, y: _scale(_scale(x, 1, 2**-0.5) + _scale(y, 1, 2**-0.5), 2**-0.5, 1))
    # A single value: output scale 1 (the library's), and so every scale 1.
    _check({"x": (8, 32), "y": (1,)}, lambda x, y: U.add(x, y), lambda x, y: x + y)


def test_rms_norm_of_float64_follows_the_library() -> None:
    # The library's RMS is computed in float32 whatever the input's type.
    rows = 16

    def library(x: Tensor, weight: Tensor) -> Tensor:
        rms = (x.float().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt().to(x.dtype)
        return x / rms * _scale(weight, 1, rows**-0.5)

    _check({"x": (rows, 64), "weight": (64,)}, lambda x, weight: U.rms_norm(x, (64,), weight),
           library)


def test_core_rms_of_float64_follows_the_library() -> None:
    _check({"x": (16, 64)}, lambda x: uu.core.functional.rms(x, dims=(-1,), keepdim=True),
           lambda x: x.float().pow(2).mean(-1, keepdim=True).sqrt().to(x.dtype))


def test_embedding_max_norm_leaves_the_weight_under_the_library_rules() -> None:
    weight = torch.randn(10, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weight.mul_(3)
    before = weight.clone()
    ids = torch.tensor([1, 2, 2, 7])
    with uu.rules(LIBRARY):
        out = U.embedding(ids, weight, max_norm=1.0)
    assert torch.equal(weight, before)
    assert out.norm(dim=-1).max().item() <= 1.0 + TOLERANCE
    U.embedding(ids, weight, max_norm=1.0)  # this package's rule: torch's, in place
    assert weight[1].norm().item() <= 1.0 + TOLERANCE


def test_the_switch_is_restored_nested_and_per_thread() -> None:
    assert uu.active_rules() == "ipu-unit-scaling" and uu.RULES == ("ipu-unit-scaling", LIBRARY)
    with pytest.raises(ValueError, match="unit-scaling"):
        with uu.rules("unit_scaling"):
            pass
    seen: List[str] = []
    with uu.rules(LIBRARY):
        assert uu.active_rules() == LIBRARY
        with uu.rules("ipu-unit-scaling"):
            assert uu.active_rules() == "ipu-unit-scaling"
        assert uu.active_rules() == LIBRARY
        # A thread started inside the block has its own setting: this package's rules.
        thread = threading.Thread(target=lambda: seen.append(uu.active_rules()))
        thread.start()
        thread.join()
    assert seen == ["ipu-unit-scaling"]
    assert uu.active_rules() == "ipu-unit-scaling"
    with pytest.raises(RuntimeError):
        with uu.rules(LIBRARY):
            raise RuntimeError("left by an exception")
    assert uu.active_rules() == "ipu-unit-scaling"

    # Another thread inside the switch does not change this thread's rules.
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with uu.rules(LIBRARY):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(10)
    x = torch.randn(4, 16, dtype=torch.float64)
    try:
        assert uu.active_rules() == "ipu-unit-scaling"
        assert torch.equal(U.softmax(x, -1), _ours_softmax(x))
    finally:
        release.set()
        thread.join()


def _ours_softmax(x: Tensor) -> Tensor:
    with uu.rules("ipu-unit-scaling"):
        return U.softmax(x, -1)


def test_a_block_left_out_of_order_removes_its_own_setting() -> None:
    # A generator suspended inside the switch, closed while another block is open: leaving it
    # removes its own setting, not the open block's.
    def suspended():
        with uu.rules(LIBRARY):
            yield uu.active_rules()

    generator = suspended()
    assert next(generator) == LIBRARY
    with uu.rules("ipu-unit-scaling"):
        generator.close()
        assert uu.active_rules() == "ipu-unit-scaling"
    with uu.rules(LIBRARY):
        generator = suspended()
        next(generator)
    generator.close()
    assert uu.active_rules() == "ipu-unit-scaling"
    x = torch.randn(4, 16, dtype=torch.float64)
    assert torch.equal(U.softmax(x, -1), _ours_softmax(x))


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 1),
                    reason="the graph transforms' TorchDynamo traces into modules from torch 2.1")
def test_compiled_code_follows_the_switch_in_and_out() -> None:
    compiled = torch.compile(lambda x: U.softmax(x, -1, constraint=None), backend="eager")
    x = torch.randn(4, 16, dtype=torch.float64)
    ours = U.softmax(x, -1, constraint=None)
    torch.testing.assert_close(compiled(x), ours, rtol=TOLERANCE, atol=0)
    with uu.rules(LIBRARY):
        library = U.softmax(x, -1, constraint=None)
        torch.testing.assert_close(compiled(x), library, rtol=TOLERANCE, atol=0)
    torch.testing.assert_close(compiled(x), ours, rtol=TOLERANCE, atol=0)
    assert not torch.allclose(ours, library)


def test_a_decorated_function_runs_under_the_library_rules() -> None:
    @uu.rules(LIBRARY)
    def inside() -> str:
        return uu.active_rules()

    assert inside() == LIBRARY and uu.active_rules() == "ipu-unit-scaling"

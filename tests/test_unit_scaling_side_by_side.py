"""scripts/unit_scaling_side_by_side.py: the comparison with unit-scaling 0.3.5 itself.

The harness is tested here against our own package with one op changed (no library needed). The
comparison with the library runs when ``IPU_UNIT_SCALING_LIBRARY_WHEEL`` names its wheel or a
directory it is installed in with its dependencies (``pip install --target DIR
unit-scaling==0.3.5``); nothing is downloaded, and the test is skipped with the reason otherwise.
CI runs the script itself, with the library fetched, in its conformance step.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import ROOT as REPO

pytestmark = pytest.mark.numerics

def _load_script() -> Any:
    # scripts/ is not a package: load the script by path.
    spec = importlib.util.spec_from_file_location(
        "unit_scaling_side_by_side", REPO / "scripts" / "unit_scaling_side_by_side.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> Any:
    return _load_script()


def _with_op(script: Any, name: str, op: Any) -> Any:
    """Our API with ``U.<name>`` replaced: a stand-in for a library that differs in one op."""
    ours = script.load_ours()
    functional = SimpleNamespace(**{n: getattr(ours.U, n) for n in dir(ours.U)
                                    if not n.startswith("__")})
    setattr(functional, name, op)
    return script.Api(U=functional, uu=ours.uu)


def _case(script: Any, name: str) -> Any:
    return next(case for case in script.all_cases() if case.name == name)


def test_identical_packages_compare_equal(script: Any) -> None:
    ours = script.load_ours()
    for name in ["U.linear 8x16->48 bias=True constraint=gmean", "U.softmax n=16 mult=1.0 "
                 "constraint=None", "uu.TransformerDecoder 64, 2 layers: loss"]:
        outcome = script.compare(_case(script, name), ours, ours)
        assert outcome.verdict == "equal", outcome
        assert outcome.difference == 0.0


def test_a_changed_gradient_is_unexpected(script: Any) -> None:
    ours = script.load_ours()
    from ipu_unit_scaling.scale import scale_bwd

    def linear_with_weight_grad_off(input, weight, bias=None, constraint="to_output_scale"):
        return ours.U.linear(input, scale_bwd(weight, 1.001), bias, constraint=constraint)

    library = _with_op(script, "linear", linear_with_weight_grad_off)
    outcome = script.compare(
        _case(script, "U.linear 4x32x64->48 bias=False constraint=None"), ours, library)
    assert outcome.verdict == "UNEXPECTED"
    assert outcome.worst == "grad weight"
    assert outcome.difference == pytest.approx(0.001 / 1.001, rel=1e-6)


def test_a_documented_difference_must_be_only_a_rescaling(script: Any) -> None:
    ours = script.load_ours()
    softmax = _case(script, "U.softmax n=16 mult=1.0 constraint=None")
    rescaled = _with_op(script, "softmax", lambda x, dim, **kw: 1.1 * ours.U.softmax(x, dim, **kw))
    outcome = script.compare(softmax, ours, rescaled)
    assert outcome.verdict == "documented", outcome
    assert "ours = library x 0.909..0.909" in outcome.note

    def softmax_and_shift(x, dim, **kw):
        return ours.U.softmax(x, dim, **kw) + 0.01
    assert script.compare(softmax, ours, _with_op(script, "softmax", softmax_and_shift)
                          ).verdict == "UNEXPECTED"


def test_a_module_difference_must_come_from_its_named_ops(script: Any) -> None:
    # The stand-in library's MLP differs from ours in U.silu_glu, which the case names, and in
    # U.linear, which it does not: running our silu_glu in it leaves the linear's difference.
    ours = script.load_ours()
    mlp = _case(script, "uu.MLP 64")
    from ipu_unit_scaling.scale import scale_fwd
    library = _with_op(script, "silu_glu",
                       lambda x, g, mult=1.0: 1.1 * ours.U.silu_glu(x, g, mult=mult))

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            base = ours.uu.MLP(64)
            self.linear_1, self.linear_gate, self.linear_2 = (
                base.linear_1, base.linear_gate, base.linear_2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            up = scale_fwd(self.linear_1(x), 1.01)  # a difference outside U.silu_glu
            return self.linear_2(library.U.silu_glu(up, self.linear_gate(x)))

    build = mlp.module
    mlp.module = lambda api: Mlp() if api is library else build(api)
    outcome = script.compare(mlp, ours, library)
    assert outcome.verdict == "UNEXPECTED", outcome
    assert "when the library's module runs our U.silu_glu" in outcome.note

    plain = Mlp.forward
    Mlp.forward = lambda self, x: self.linear_2(  # type: ignore[method-assign]
        library.U.silu_glu(self.linear_1(x), self.linear_gate(x)))
    outcome = script.compare(mlp, ours, library)
    Mlp.forward = plain  # type: ignore[method-assign]
    assert outcome.verdict == "documented", outcome


def test_under_the_switch_every_case_must_be_equal(script: Any) -> None:
    # Ours under uu.rules("unit-scaling") against a stand-in library that is ours under the
    # switch: equal. A stand-in whose softmax is rescaled: its documented difference is allowed
    # without the switch, but under it the case is UNEXPECTED.
    ours = script.load_ours()
    softmax = _case(script, "U.softmax n=16 mult=1.0 constraint=None")

    def switched_softmax(x, dim, **kw):
        with ours.uu.rules("unit-scaling"):
            return ours.U.softmax(x, dim, **kw)

    outcome = script.compare(softmax, ours, _with_op(script, "softmax", switched_softmax))
    assert outcome.verdict == "documented" and outcome.switched_verdict == "equal", outcome
    assert outcome.switched_difference == 0.0
    outcome = script.compare(softmax, ours, _with_op(
        script, "softmax", lambda x, dim, **kw: 1.1 * switched_softmax(x, dim, **kw)))
    assert outcome.verdict == "documented" and outcome.switched_verdict == "UNEXPECTED"
    assert outcome.switched_difference == pytest.approx(0.1 / 1.1, rel=1e-9)
    assert "UNEXPECTED" in script.format_report([outcome], None).splitlines()[-1]


def test_missing_wheel_is_a_reason_not_a_crash(script: Any) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        with pytest.raises(script.LibraryUnavailable):
            script.prepare_site(Path(scratch) / "absent.whl", Path(scratch), download=False)


def test_against_the_library() -> None:
    source = os.environ.get("IPU_UNIT_SCALING_LIBRARY_WHEEL")
    if not source:
        pytest.skip("IPU_UNIT_SCALING_LIBRARY_WHEEL names no unit-scaling 0.3.5 wheel")
    script = _load_script()
    with tempfile.TemporaryDirectory() as scratch:
        try:
            library = script.load_library(
                script.prepare_site(Path(source), Path(scratch), download=False))
        except script.LibraryUnavailable as reason:
            pytest.skip(str(reason))
        ours = script.load_ours()
        outcomes = [script.compare(case, ours, library) for case in script.all_cases()]
        curves = script.train_side_by_side(ours, library, steps=3)
    unexpected = [o for o in outcomes if o.verdict == "UNEXPECTED"]
    assert not unexpected, unexpected
    assert sum(o.verdict == "equal" for o in outcomes) >= 40
    # The decoders differ only by the ops named, so training with those swapped in matches.
    assert curves.ours == pytest.approx(curves.library_with_our_ops, rel=1e-5)
    # Under uu.rules("unit-scaling") every case, the library's example decoder and the model of
    # the other shared rules among them, equals the library, and so does training.
    not_equal = [o for o in outcomes if o.switched_verdict != "equal"]
    assert not not_equal, not_equal
    assert any("example u-μP decoder" in o.name for o in outcomes)
    assert len(curves.ours_under_library_rules) == 3 and script.curves_follow(curves)

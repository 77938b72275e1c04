"""``poptorch.custom_op`` on the PopTorch stand-in: the host numerics an op library registers
(:mod:`ipu_standins.poptorch_custom_ops`), one op of the traced graph."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins import poptorch_custom_ops
from ipu_standins.poptorch_trace import trace_like_poptorch

DOMAIN = "test.standin"


def _doubled(inputs, attributes):
    # Several ATen ops, one of them (aten::special_i0) with no PopTorch handler: inside a
    # custom op they are not checked, as PopART's op is not.
    return [torch.special.i0(inputs[0] * 0) + inputs[0] * float(attributes["factor"]) - 1]


@pytest.fixture
def doubled():
    poptorch_custom_ops.register_op(DOMAIN, "Doubled", _doubled)
    yield
    poptorch_custom_ops.unregister_op(DOMAIN, "Doubled")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        (y,) = poptorch.custom_op([x * self.weight], "Doubled", DOMAIN, 1,
                                  example_outputs=[x], attributes={"factor": 2.0})
        return y


def test_a_registered_op_runs_its_numerics_unchecked(doubled):
    x = torch.tensor([1.0, 2.0, 3.0])
    trace = trace_like_poptorch(Model(), x)
    assert trace.report.ok, str(trace.report)
    assert torch.equal(trace(x), x * 2)


def test_an_op_no_library_registered_is_refused():
    with pytest.raises(poptorch.Error, match="no host implementation"):
        poptorch.custom_op([torch.ones(2)], "Missing", DOMAIN, 1, example_outputs=[])


def test_named_libraries_are_imported_when_an_op_is_not_found(tmp_path):
    (tmp_path / "library_for_test.py").write_text(
        "from ipu_standins import poptorch_custom_ops\n"
        "poptorch_custom_ops.register_op('test.env', 'Neg', lambda i, a: [-i[0]])\n")
    code = ("import torch, ipu_standins.poptorch as p\n"
            "print(p.custom_op([torch.ones(2)], 'Neg', 'test.env', 1, [])[0].tolist())\n")
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}",
           poptorch_custom_ops.LIBRARIES_ENV: "library_for_test"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[-1.0, -1.0]"


def test_a_library_first_needed_inside_a_traced_model_loads_outside_the_trace(tmp_path):
    # The library reads a tensor on the host as it loads, which the tracer would refuse in a
    # model: it loads outside the trace, as a real library is loaded before PopART sees the op.
    (tmp_path / "library_at_trace.py").write_text(
        "import torch\n"
        "from ipu_standins import poptorch_custom_ops\n"
        "FACTOR = float(torch.ones(1).numpy()[0]) * 3\n"
        "poptorch_custom_ops.register_op('test.trace', 'Triple', lambda i, a: [i[0] * FACTOR])\n")
    code = ("import torch, ipu_standins.poptorch as p\n"
            "from ipu_standins.poptorch_trace import trace_like_poptorch\n"
            "class M(torch.nn.Module):\n"
            "    def forward(self, x):\n"
            "        return p.custom_op([x], 'Triple', 'test.trace', 1, [x])[0]\n"
            "x = torch.ones(2)\n"
            "trace = trace_like_poptorch(M(), x)\n"
            "assert trace.report.ok, str(trace.report)\n"
            "print(trace(x).tolist())\n")
    env = {"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}",
           poptorch_custom_ops.LIBRARIES_ENV: "library_at_trace"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[3.0, 3.0]"

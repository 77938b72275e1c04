"""``popxl.tensor`` of the PopXL stand-in against PopXL's (popart:
python/popxl/python_files/tensor.py)."""
from __future__ import annotations

import ipu_standins.popxl as popxl_standin


def test_variable_and_constant_are_in_tensor_only():
    for name in ("Variable", "Constant"):
        assert not hasattr(popxl_standin, name)
        assert name not in popxl_standin.__all__
    ir = popxl_standin.Ir()
    with ir.main_graph:
        weight = popxl_standin.variable([1.0, 2.0])
        scale = popxl_standin.constant(2.0)
    assert isinstance(weight, popxl_standin.tensor.Variable)
    assert isinstance(scale, popxl_standin.tensor.Constant)
    assert isinstance(weight, popxl_standin.tensor.Tensor)
    assert repr(weight).startswith("Variable[") and repr(scale).startswith("Constant[")

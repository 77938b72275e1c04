"""``popxl.tensor`` of the PopXL stand-in against PopXL's (popart:
python/popxl/python_files/tensor.py, dtypes.py): where Variable and Constant live, the names
shared with the top level, a tensor's repr and ``TensorSpec``."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

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


def test_the_module_s_names_are_the_top_level_s():
    tensor = popxl_standin.tensor
    assert dir(tensor) == sorted(tensor.__all__)
    for name in ("Tensor", "TensorSpec", "variable", "constant"):
        assert getattr(tensor, name) is getattr(popxl_standin, name)
    assert issubclass(tensor.Variable, tensor.Tensor) and issubclass(tensor.Constant,
                                                                      tensor.Tensor)


def test_a_tensor_s_repr_names_its_kind_id_dtype_and_shape():
    ir = popxl_standin.Ir()
    with ir.main_graph:
        weight = popxl_standin.variable(np.zeros((2, 3), np.float16), name="w")
        out = weight + 1.0
    assert repr(weight) == f"Variable[{weight.name} popxl.dtypes.float16 (2, 3)]"
    assert repr(out) == f"Tensor[{out.name} popxl.dtypes.float16 (2, 3)]"
    assert type(out) is popxl_standin.tensor.Tensor  # an op's output is neither kind


def test_a_tensor_spec_is_a_frozen_value():
    spec = popxl_standin.TensorSpec((2,), popxl_standin.float32)
    assert spec == popxl_standin.TensorSpec((2,), popxl_standin.float32)
    assert len({spec, popxl_standin.TensorSpec((2,), popxl_standin.float32)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.shape = (3,)  # type: ignore[misc]

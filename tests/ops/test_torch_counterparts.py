"""`U.torch_map` (unit-scaling's ``functional.torch_map``): torch's functions -> the
unit-scaled ops of the same name."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import ipu_unit_scaling.functional as U


def test_each_op_with_a_torch_namesake_is_mapped_from_it():
    for name in U.__all__:
        torch_function = getattr(F, name, None) or getattr(torch, name, None)
        if callable(torch_function):
            assert U.torch_map[torch_function] is getattr(U, name), name
    assert U.torch_map[F.gelu] is U.gelu and U.torch_map[torch.matmul] is U.matmul


def test_functional_names_are_preferred_and_only_ops_are_values():
    assert U.torch_map[F.softmax] is U.softmax and torch.softmax not in U.torch_map
    assert set(U.torch_map.values()) <= {getattr(U, name) for name in U.__all__}
    assert "torch_map" not in U.__all__  # as in unit-scaling: not a star-import name

"""``poptorch.testing.allclose`` of the PopTorch stand-in against PopTorch's
(python/testing.py): the structures must match (a tuple for a tuple, a list for a list, the
same lengths) and every tensor pair be ``torch.allclose(other, ref)``, with ``ref`` the
reference the relative tolerance scales with."""
from __future__ import annotations

import collections

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch.testing import allclose

# torch.allclose's defaults: |other - ref| <= 1e-8 + 1e-5 * |ref|. With ref = 1 + D and
# other = 1 the bound is 1.00101005e-5 >= D; swapped (ref = 1) it is 1.001e-5 < D. D lies
# 5e-11 from each bound; float64 holds 1 + D to within 1.2e-16.
D = 1.001005e-5
ONE = torch.tensor([1.0], dtype=torch.float64)


def test_the_module_is_poptorch_testing():
    assert poptorch.testing.allclose is allclose


def test_the_tolerance_scales_with_the_reference():
    assert allclose(ONE + D, ONE)
    assert not allclose(ONE, ONE + D)


def test_nested_structures_compare_element_by_element():
    a, b = torch.arange(3.0), torch.ones(2, 2)
    assert allclose((a, [b, (a,)]), (a.clone(), [b.clone(), (a + 1e-9,)]))
    assert not allclose((a, [b, (a,)]), (a, [b, (a + 1,)]))


@pytest.mark.parametrize("other", [
    [torch.zeros(2)],                  # a list for a tuple
    (torch.zeros(2), torch.zeros(2)),  # another length
    (torch.zeros(2),)[:0],             # empty
])
def test_a_different_structure_is_not_close(other):
    assert not allclose((torch.zeros(2),), other)
    assert not allclose([torch.zeros(2)], tuple(other))


def test_a_named_tuple_matches_a_tuple():
    Pair = collections.namedtuple("Pair", "x y")
    x = torch.ones(2)
    assert allclose((x, x), Pair(x, x.clone()))
    assert allclose(Pair(x, x), (x, x))


def test_a_tensor_reference_needs_a_tensor():
    with pytest.raises(TypeError):
        allclose(torch.zeros(1), [torch.zeros(1)])


@pytest.mark.parametrize("ref", [1.0, None, {"a": torch.zeros(1)}])
def test_references_other_than_tensors_tuples_and_lists_are_refused(ref):
    with pytest.raises(TypeError, match="not supported"):
        allclose(ref, ref)

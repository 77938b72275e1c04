"""PopTorch compiles static shapes: an op whose output size depends on the values of an input
(boolean-mask indexing) raises torch's ``DynamicOutputShapeException`` while tracing, as it
does in PopTorch (its ``index_ops_test.py``), whatever torch version traces it; ``bincount``
with a ``minlength`` has ``minlength`` bins, as PopTorch's handler computes it
(``OtherOps.cpp``)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException

import ipu_standins.poptorch as poptorch


class _Mask(torch.nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x[mask]


class _Bincount(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor):
        return torch.bincount(x, minlength=4), torch.bincount(x, w, minlength=4)


def test_boolean_mask_indexing_of_an_input_raises_dynamic_output_shape():
    with pytest.raises(DynamicOutputShapeException):
        poptorch.inferenceModel(_Mask())(torch.randn(2, 3), torch.tensor([True, False]))


def test_a_boolean_mask_assignment_keeps_its_shape_and_compiles():
    class Assign(torch.nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            x = x.clone()
            x[mask] = 0.0
            return x

    x, mask = torch.ones(2, 3), torch.tensor([True, False])
    assert torch.equal(poptorch.inferenceModel(Assign())(x, mask),
                       torch.tensor([[0.0] * 3, [1.0] * 3]))


def test_bincount_has_minlength_bins_and_counts_larger_values_as_poptorchs_handler():
    w = torch.tensor([0.5, 0.25, 2.0, 4.0, 8.0])
    counts, weighted = poptorch.inferenceModel(_Bincount())(torch.tensor([0, 1, 1, 3, 2]), w)
    assert counts.tolist() == [1, 2, 1, 1]
    assert weighted.tolist() == [0.5, 2.25, 8.0, 4.0]
    # 9 is past the last bin: the handler counts it at index len(x) - 1 = 4, itself past the
    # last of the 4 bins, so it is dropped; torch would make 10 bins.
    counts, weighted = poptorch.inferenceModel(_Bincount())(torch.tensor([0, 1, 1, 9, 2]), w)
    assert counts.tolist() == [1, 2, 1, 0]
    assert weighted.tolist() == [0.5, 2.25, 8.0, 0.0]

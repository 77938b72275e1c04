"""``poptorch.dynamic_slice`` and ``poptorch.dynamic_update``: PopTorch's slice handlers' checks
on the IPU, a plain slice (scatter) on the host, and a start that is an input of the graph."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _Slice(torch.nn.Module):
    def __init__(self, size: int, step: int = 1) -> None:
        super().__init__()
        self.size, self.step = size, step

    def forward(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return poptorch.dynamic_slice(x, 0, start, self.size, self.step)


class _Update(torch.nn.Module):
    def __init__(self, size: int, dim: int = 0) -> None:
        super().__init__()
        self.size, self.dim = size, dim

    def forward(self, x: torch.Tensor, src: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return poptorch.dynamic_update(x, src, self.dim, start, self.size)


def test_the_start_is_read_at_run_time_not_compiled_in():
    model = poptorch.inferenceModel(_Slice(4, 2))
    x = torch.arange(8.0)
    model.compile(x, torch.tensor([3]))
    assert torch.equal(model(x, torch.tensor([1])), torch.tensor([1.0, 3.0]))
    assert torch.equal(model(x, torch.tensor([4])), torch.tensor([4.0, 6.0]))


@pytest.mark.parametrize("size, message", [
    (0, "The start and end of a slice must be different"),
    (-2, "Taking a slice of a tensor with the end less than the start is not supported"),
    (3, r"The size of the slice \(3\) must be a factor of the slicing dimension \(8\)"),
])
def test_slices_the_handler_refuses(size, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(_Slice(size)).compile(torch.arange(8.0), torch.tensor([1]))


def test_on_the_host_a_dynamic_slice_is_a_plain_slice():
    assert torch.equal(_Slice(-2)(torch.arange(8.0), torch.tensor([5])), torch.zeros(0))


@pytest.mark.parametrize("dim", [0, 1])
def test_dynamic_update_writes_the_slice_at_the_start_given_at_run_time(dim):
    x = torch.arange(12.0).reshape(3, 4) if dim == 1 else torch.arange(12.0).reshape(4, 3)
    src = -torch.ones_like(x).narrow(dim, 0, 2)
    model = poptorch.inferenceModel(_Update(2, dim))
    model.compile(x, src, torch.tensor([0]))
    for start in (1, 2):
        expected = x.clone()
        expected.narrow(dim, start, 2).copy_(src)
        assert torch.equal(model(x, src, torch.tensor([start])), expected)
        assert torch.equal(_Update(2, dim)(x, src, torch.tensor([start])), expected)


def test_dynamic_update_compares_dtypes_as_the_ipu_holds_them():
    model = poptorch.inferenceModel(_Update(1))
    with pytest.raises(poptorch.Error, match=r"same dtype\. \(torch\.float32 vs torch\.int32\)"):
        model.compile(torch.zeros(4), torch.tensor([1]), torch.tensor([0]))

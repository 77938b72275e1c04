"""In-place ops as PopTorch compiles them: ``zero_`` and ``fill_`` (PopTorch's in-place pass
rewrites them as ``zeros_like`` and ``full_like``), writes to inputs, buffers and slices, and
PopTorch's refusal to modify a slice with a step in place."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _ZeroThenAdd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> None:
        total = x.sum()
        x.zero_()
        x += total


class _FillBufferAndInput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buffer", torch.ones(1, 2))

    def forward(self, x: torch.Tensor):
        x.fill_(3.0)
        self.buffer.copy_(self.buffer + x)
        return self.buffer, x


def test_zero_on_an_input_is_compiled_and_written_back_to_the_callers_tensor():
    x = torch.tensor([[0.0, 0.5], [0.25, 2.0]])
    poptorch.inferenceModel(_ZeroThenAdd())(x)
    assert torch.equal(x, torch.full((2, 2), 2.75))  # sums of dyadic numbers: exact


def test_fill_on_an_input_and_copy_into_a_buffer():
    model = poptorch.inferenceModel(_FillBufferAndInput())
    buffer, out = model(torch.ones(1, 2))
    assert torch.equal(out, torch.full((1, 2), 3.0))
    assert torch.equal(buffer, torch.full((1, 2), 4.0))


def _step_of(step: torch.Tensor):
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # A constant tensor read on the host: PopTorch evaluates it while tracing.
            x[:, :2:int(step.item())].mul_(0)
            return x
    return Model()


def test_a_chained_slice_with_step_one_is_modified_in_place():
    x = torch.arange(16.0).reshape(4, 4)
    expected = x.clone()
    expected[:, :2] = 0
    out = poptorch.inferenceModel(_step_of(torch.tensor(1)))(x)
    assert torch.equal(out, expected) and torch.equal(x, expected)


def test_modifying_a_slice_with_a_step_in_place_is_refused():
    with pytest.raises(poptorch.Error, match=r"^In-place modification of slices with step "
                       r"size other than 1 is not supported\."):
        poptorch.inferenceModel(_step_of(torch.tensor(2))).compile(torch.ones(4, 4))


def test_reading_a_slice_with_a_step_is_not_refused():
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[::2] * 2

    out = poptorch.inferenceModel(Model())(torch.ones(4, 4))
    assert torch.equal(out, torch.full((2, 4), 2.0))


def test_a_training_model_copies_a_value_that_needs_gradients_into_its_input():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((3,), 2.0))

        def forward(self, x: torch.Tensor, y: torch.Tensor):
            y.copy_(x * self.weight)
            return y, poptorch.identity_loss(y.sum(), "sum")

    options = poptorch.Options().deviceIterations(2)
    model = poptorch.trainingModel(Model(), options)
    x, y = torch.ones(2, 3), torch.zeros(2, 3)
    out, _ = model(x, y)
    # Each micro-batch's y is a view of the caller's y, written in place: the first with the
    # initial weight (2, exact), the second after one SGD step (lr 0.01, gradient 1): 1.99,
    # rounded twice in float32. Final returns the last one.
    assert torch.equal(y[0], torch.full((3,), 2.0))
    assert torch.all((y[1] - 1.99).abs() <= 2 * 2.0 ** -24 * 2)
    assert torch.equal(out, y[1:])

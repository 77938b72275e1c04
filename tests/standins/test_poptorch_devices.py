"""CPU and IPU tensors while PopTorch traces ``forward``.

PopTorch (c2a8b17762f1) makes the tensors of ``torch.zeros``, ``torch.tensor`` and the other
factories of ``_SetDefaultDeviceType`` on the IPU when no device is given; any other tensor made
inside ``forward`` without a device (a legacy constructor such as ``torch.LongTensor``,
``torch.eye``, ``torch.as_tensor``) is a CPU tensor, and its dispatcher refuses a CPU tensor
among an op's IPU inputs (``TypeInferenceHandler::toMeta``). ``cpu_tensor.to("ipu")`` makes it a
constant on the IPU, as the error message advises.
"""
from __future__ import annotations

import re
from typing import Callable

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _Forward(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _refusal(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> str:
    with pytest.raises(poptorch.Error) as caught:
        poptorch.inferenceModel(_Forward(fn)).compile(x)
    return str(caught.value)


def test_a_legacy_constructors_cpu_tensor_among_ipu_inputs_is_refused_as_poptorch_words_it():
    message = _refusal(lambda x: torch.index_select(x, 0, torch.LongTensor([1, 0])),
                       torch.rand(4))
    assert re.search(re.escape("Expected an IPU tensor but got tensor(device=cpu, shape=[2], "
                               "dtype=Long)"), message), message
    assert 'cpu_tensor.to("ipu")' in message


def test_factories_poptorch_leaves_on_the_cpu_are_refused_with_their_shape_and_dtype():
    message = _refusal(lambda x: x @ torch.eye(3, dtype=torch.float64).float(), torch.rand(2, 3))
    assert "tensor(device=cpu, shape=[3, 3], dtype=Float)" in message, message
    message = _refusal(lambda x: x * torch.as_tensor([1.0, 2.0]), torch.rand(2))
    assert "tensor(device=cpu, shape=[2], dtype=Float)" in message, message


def test_cpu_tensors_among_themselves_and_moved_to_the_ipu_are_accepted():
    def fn(x: torch.Tensor) -> torch.Tensor:
        index = torch.LongTensor([1, 0]) + 1  # CPU with CPU: evaluated on the CPU
        return torch.index_select(x, 0, index.to("ipu")) + torch.eye(2).to(x.device)

    x = torch.tensor([1.0, 2.0, 3.0])
    out = poptorch.inferenceModel(_Forward(fn))(x)
    assert torch.equal(out, torch.tensor([[4.0, 2.0], [3.0, 3.0]]))


def test_the_factories_poptorch_forces_onto_the_ipu_and_a_device_given_are_accepted():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + torch.tensor([1.0, 2.0]) + torch.zeros(2) + torch.eye(2, device="ipu")[0]

    out = poptorch.inferenceModel(_Forward(fn))(torch.ones(2))
    assert torch.equal(out, torch.tensor([3.0, 3.0]))


def test_the_message_names_shape_and_dtype_as_c10_prints_them_and_ipu_devices_are_recognised():
    from ipu_standins.poptorch._devices import cpu_tensor_refusal, names_ipu, on_host

    assert cpu_tensor_refusal(torch.zeros(2, 3, dtype=torch.int32)).startswith(
        "Expected an IPU tensor but got tensor(device=cpu, shape=[2, 3], dtype=Int).\n")
    assert "shape=[], dtype=Half" in cpu_tensor_refusal(torch.tensor(1.0).half())
    assert names_ipu("ipu") and names_ipu("ipu:0") and names_ipu(torch.device("ipu"))
    assert not names_ipu("cpu") and not names_ipu(torch.float32)
    assert on_host("ipu:0") == "cpu" and on_host(torch.device("ipu")) == torch.device("cpu")
    assert on_host(torch.float16) is torch.float16

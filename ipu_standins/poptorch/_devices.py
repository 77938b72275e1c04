"""CPU and IPU tensors while PopTorch traces ``forward``.

PopTorch moves the model's parameters and buffers and the call's inputs to the IPU. While it
traces, the factory functions of `IPU_FACTORIES` make their tensors on the IPU when no device
is given (``_SetDefaultDeviceType``, ``_poplar_executor.py``); any other way of making a tensor
without a device inside ``forward`` (``torch.eye``, ``torch.as_tensor``, ``torch.from_numpy``,
a legacy constructor such as ``torch.LongTensor([1, 0])``) makes a CPU tensor. Its dispatcher
refuses a CPU tensor among an op's IPU inputs (``TypeInferenceHandler::toMeta``), except in a
copy onto the IPU, which uploads it as a constant (``cpu_tensor.to("ipu")``).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["IPU_FACTORIES", "LEGACY_CONSTRUCTOR_OPS", "UPLOADS", "cpu_tensor_refusal",
           "names_ipu", "on_host"]

IPU_FACTORIES = frozenset(getattr(torch, name) for name in (
    "arange", "empty", "full", "full_like", "linspace", "logspace", "ones", "rand", "randint",
    "randn", "randperm", "range", "tensor", "zeros", "zeros_like", "normal")
    if hasattr(torch, name))
# What a legacy constructor dispatches, with no torch function around it.
LEGACY_CONSTRUCTOR_OPS = frozenset(("lift_fresh", "empty"))
# Ops that take a CPU tensor next to an IPU one (`copy_` in `RegisterAtenOverloads.cpp`).
UPLOADS = frozenset(("copy_", "copy", "_to_copy"))
# c10's names of the dtypes, as PopTorch's errors print them.
_C10_DTYPE_NAMES = {
    torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
    torch.int64: "Long", torch.float16: "Half", torch.float32: "Float", torch.float64: "Double",
    torch.bool: "Bool", torch.bfloat16: "BFloat16"}


def cpu_tensor_refusal(tensor: torch.Tensor) -> str:
    """PopTorch's message for a CPU tensor among an op's IPU inputs."""
    dtype = _C10_DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).replace("torch.", ""))
    return (f"Expected an IPU tensor but got tensor(device=cpu, shape={list(tensor.shape)}, "
            f"dtype={dtype}).\nConstant tensors should be moved explicitly to the IPU, via "
            'cpu_tensor.to("ipu").')


def names_ipu(value: Any) -> bool:
    """Whether ``value`` is the device ``"ipu"`` (a string or a ``torch.device``)."""
    if isinstance(value, str):
        return value.split(":")[0] == "ipu"
    return isinstance(value, torch.device) and value.type == "ipu"


def on_host(value: Any) -> Any:
    """``device="ipu"`` (what PopTorch programs ask for while tracing: ``"ipu:0"``, a
    ``torch.device("ipu", 0)``) as the host's CPU with no index, the device the parameters are
    traced on (torch's fake tensors take ``cpu:0`` for another device)."""
    if isinstance(value, str) and names_ipu(value):
        return "cpu"
    if isinstance(value, torch.device) and names_ipu(value):
        return torch.device("cpu")
    return value

"""The stand-in's trace on its own, without the package's ops: PopTorch's refusals raise the
stand-in's ``poptorch.Error``, and ops without a handler are reported by module."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch_trace import trace_like_poptorch


class Reads(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum())


class Unsupported(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.i0(self.inner(x))


def test_a_host_read_is_refused_with_poptorchs_error():
    with pytest.raises(poptorch.Error, match="read on the host"):
        trace_like_poptorch(Reads(), torch.ones(3))


def test_an_op_without_a_handler_is_reported_with_its_module():
    report = trace_like_poptorch(Unsupported(), torch.ones(2, 3)).report
    assert not report.ok
    # aten::i0 on torch 2.13 (the name may differ between torch versions).
    [(op, modules)] = report.unsupported.items()
    assert op.startswith("aten::") and op.endswith("i0") and modules == ["Unsupported"]

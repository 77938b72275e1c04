"""The PopTorch stand-in's own setting: ``torch_numerics()`` keeps a trace computing what eager
torch computes, where the stand-in otherwise lowers GELU to PopART's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ipu_standins import poptorch_settings
from ipu_standins.poptorch_trace import trace_like_poptorch


class Gelu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


def _targets(trace) -> set:
    return {getattr(n.target, "__name__", str(n.target)) for n in trace.graph.graph.nodes
            if n.op == "call_function"}


def test_torch_numerics_keeps_torchs_gelu_and_the_default_lowers_it():
    x = torch.linspace(-4.0, 4.0, 17)
    assert poptorch_settings.follows_ipu_numerics()
    lowered = trace_like_poptorch(Gelu(), x)
    with poptorch_settings.torch_numerics():
        assert not poptorch_settings.follows_ipu_numerics()
        eager = trace_like_poptorch(Gelu(), x)
    assert poptorch_settings.follows_ipu_numerics()
    assert "popart_gelu" in _targets(lowered) and "popart_gelu" not in _targets(eager)
    # Element-wise: torch's erf GELU bit for bit; PopART's is the tanh form.
    assert torch.equal(eager(x), F.gelu(x))
    assert torch.equal(lowered(x), F.gelu(x, approximate="tanh"))

"""``poptorch.cond`` and ``poptorch.for_loop``: inference only, as PopTorch's compiler refuses
them in a training graph (``Compiler.cpp``), and what ``cond`` returns in inference."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch


class _Cond(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def forward(self, condition: torch.Tensor, x: torch.Tensor):
        out = poptorch.cond(condition, self.layer, [x], lambda y: y * 2, [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")


class _Loop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor):
        out = poptorch.for_loop(2, lambda y: self.layer(y), [x])[0]
        return out, poptorch.identity_loss(out, reduction="sum")


@pytest.mark.parametrize("model, name", [(_Cond, "cond"), (_Loop, "for_loop")])
def test_control_flow_is_refused_in_a_training_graph(model, name):
    training = poptorch.trainingModel(model())
    inputs = (torch.tensor([True]), torch.ones(1, 2)) if name == "cond" else (torch.ones(1, 2),)
    message = rf"poptorch.{name}\(\) is only supported in inference"
    with pytest.raises(poptorch.Error, match=message):
        training(*inputs)


def test_cond_chooses_the_branch_in_inference():
    module = _Cond()
    inference = poptorch.inferenceModel(module)
    x = torch.tensor([[1.0, -1.0]])
    out, _ = inference(torch.tensor([False]), x)
    assert torch.equal(out, x * 2)
    out, _ = inference(torch.tensor([True]), x)
    assert torch.allclose(out, module.layer(x))

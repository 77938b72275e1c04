"""What a user saves from a model after ``poptorch.trainingModel`` trained it (its state dict,
its parameters and buffers, its optimizer's state dict) loads with ``torch.load``'s
weights-only reader, the default since torch 2.6: the PopTorch stand-in's wrapped parameters
and buffers pickle as plain ones, and the trained model's ``state_dict`` holds plain tensors,
as PopTorch's does (python/_poplar_executor.py)."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ipu_standins.poptorch as poptorch


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x, target):
        out = self.norm(self.fc(x))
        return out, F.mse_loss(out, target)


class _Holder(torch.nn.Module):
    """A module that holds the trained one, as Lightning's module holds its wrapper's model."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net


def _trained(optimizer_type: Any = poptorch.optim.SGD):
    torch.manual_seed(0)
    net = _Net()
    optimizer = (optimizer_type(net.parameters(), lr=0.1, momentum=0.9)
                 if optimizer_type in (poptorch.optim.SGD, torch.optim.SGD)
                 else optimizer_type(net.parameters(), lr=0.01))
    training = poptorch.trainingModel(net, optimizer=optimizer)
    for _ in range(2):
        training(torch.randn(8, 4), torch.randn(8, 3))
    return net, optimizer, training


def _round_trip(obj: Any, path) -> Any:
    torch.save(obj, path)
    return torch.load(path, weights_only=True)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        parameters = isinstance(a, torch.nn.Parameter), isinstance(b, torch.nn.Parameter)
        return parameters[0] == parameters[1] and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_the_trained_state_dict_holds_plain_tensors_that_share_the_model_storage():
    net, _, _ = _trained()
    for keep_vars in (False, True):
        state = net.state_dict(keep_vars=keep_vars)
        assert {type(v) for k, v in state.items() if "norm.running" in k} == {torch.Tensor}
        assert state["norm.running_mean"].data_ptr() == net.norm.running_mean.data_ptr()
    assert type(net.state_dict(keep_vars=True)["fc.weight"]) is torch.nn.Parameter


@pytest.mark.parametrize("optimizer_type", [poptorch.optim.SGD, poptorch.optim.AdamW,
                                            torch.optim.SGD, torch.optim.AdamW])
def test_what_a_user_saves_after_training_loads_with_the_weights_only_reader(
        tmp_path, optimizer_type):
    net, optimizer, training = _trained(optimizer_type)
    saved = {
        "model": net.state_dict(),
        "executor": training.state_dict(),
        "held": _Holder(net).state_dict(),
        "parameters": list(net.parameters()),
        "buffers": list(net.buffers()),
        "optimizer": optimizer.state_dict(),
    }
    for name, obj in saved.items():
        loaded = _round_trip(obj, tmp_path / f"{name}.pt")
        assert _equal(obj, loaded), name


def test_a_saved_trained_state_reloads_into_a_fresh_model(tmp_path):
    net, _, training = _trained()
    torch.save(net.state_dict(), tmp_path / "net.pt")
    fresh = _Net()
    fresh.load_state_dict(torch.load(tmp_path / "net.pt", weights_only=True))
    x, target = torch.randn(8, 4), torch.randn(8, 3)
    training.detachFromDevice()
    net.eval()
    fresh.eval()
    assert torch.equal(fresh(x, target)[0], net(x, target)[0])


def test_a_copied_buffer_is_a_plain_tensor_on_the_same_storage():
    import copy

    net, _, _ = _trained()
    buffer = net.norm.running_var
    copied = copy.copy(buffer)
    assert type(copied) is torch.Tensor
    assert copied.data_ptr() == buffer.data_ptr()

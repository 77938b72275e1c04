"""What Optimum Graphcore takes from PopTorch's private modules besides ``_poplar_executor``:
``_impl.unwrapModelIfNecessary`` and ``rewrapModelIfNecessary``, which its seq2seq trainer calls
around compiling a trained model's modules for generation. As in PopTorch's python/_impl.py,
unwrapping takes the wrappers off the model, its parameters and its buffers (their reads no
longer copy the device's weights back), and rewrapping gives the same wrappers back."""
from __future__ import annotations

import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._impl import (
    isWrapped,
    rewrapModelIfNecessary,
    unwrapModelIfNecessary,
)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)

    def forward(self, x):
        return poptorch.identity_loss(self.norm(self.fc(x)).square().sum(), reduction="none")


def _trained():
    torch.manual_seed(0)
    net = _Net()
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    training(torch.randn(4, 3))
    return net, training


def test_unwrap_then_rewrap_gives_the_same_wrappers_back():
    net, training = _trained()
    tensors = list(net.parameters()) + list(net.buffers())
    wrappers = [type(t) for t in [net] + tensors]
    assert all(isWrapped(x) for x in [net] + tensors)
    unwrapModelIfNecessary(net)
    assert type(net) is _Net
    assert all(type(t) in (torch.nn.Parameter, torch.Tensor) for t in tensors)
    rewrapModelIfNecessary(net)
    assert [type(t) for t in [net] + tensors] == wrappers


def test_an_unwrapped_model_reads_what_the_host_holds_and_a_rewrapped_one_syncs():
    net, training = _trained()
    unwrapModelIfNecessary(net)  # reading the wrapped model's parameters copies them back
    before = net.fc.weight.detach().clone()
    training(torch.randn(4, 3))  # the device's weights move on
    assert torch.equal(net.fc.weight.detach(), before)  # no copy back while unwrapped
    rewrapModelIfNecessary(net)
    assert not torch.equal(net.fc.weight.detach(), before)  # the read copies them back


def test_a_model_that_was_never_wrapped_is_left_as_it_is():
    net = _Net()
    unwrapModelIfNecessary(net)
    rewrapModelIfNecessary(net)
    assert type(net) is _Net and type(net.fc.weight) is torch.nn.Parameter

"""Ops PopTorch's dispatcher takes whole: recurrent layers (PopART's LSTM, GRU and RNN) and
bilinear, not the CPU's decomposition into ops PopTorch has no handler for."""
from __future__ import annotations

import pytest
import torch

import ipu_standins.poptorch as poptorch


@pytest.mark.parametrize("layer", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_a_recurrent_layer_compiles_and_computes_what_torch_does(layer):
    torch.manual_seed(0)
    net = layer(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    out = poptorch.inferenceModel(net)(x)
    expected = net(x)
    # Each step's gate pre-activations are 9-term sums (3 inputs, 4 states, 2 biases), at most
    # `gates` in size; the gates' nonlinearities are 1-Lipschitz and the states stay in
    # [-1, 1] (a few more ops for the cell); an error in the state grows by at most the
    # recurrent weights' largest row sum per step, over 5 steps.
    w_ih, w_hh = net.weight_ih_l0.detach().abs(), net.weight_hh_l0.detach().abs()
    biases = (net.bias_ih_l0 + net.bias_hh_l0).detach().abs()
    gates = float((x.abs().amax((0, 1)) @ w_ih.T + w_hh.sum(1) + biases).max())
    growth = float(w_hh.sum(1).max())
    per_step = 12 * 2.0 ** -24 / (1 - 12 * 2.0 ** -24) * (gates + 2)
    bound = per_step * sum(growth ** k for k in range(5))
    assert torch.all((out[0] - expected[0]).abs() <= bound)


def test_a_recurrent_layer_trains():
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = torch.nn.LSTM(3, 4)

        def forward(self, x, target):
            out, _ = self.lstm(x)
            return out, torch.nn.functional.mse_loss(out, target)

    net = Model()
    before = net.lstm.weight_ih_l0.detach().clone()
    poptorch.trainingModel(net)(torch.randn(5, 2, 3), torch.randn(5, 2, 4))
    assert not torch.equal(net.lstm.weight_ih_l0.detach(), before)


def test_bilinear_compiles_and_computes_what_torch_does():
    torch.manual_seed(0)
    net = torch.nn.Bilinear(3, 4, 2)
    x1, x2 = torch.randn(5, 3), torch.randn(5, 4)
    out = poptorch.inferenceModel(net)(x1, x2)
    expected = net(x1, x2).detach()
    # 12 products summed per output, and the bias.
    magnitude = torch.einsum("bi,oij,bj->bo", x1.abs(), net.weight.detach().abs(), x2.abs())
    bound = 14 * 2.0 ** -24 / (1 - 14 * 2.0 ** -24) * (magnitude + net.bias.detach().abs())
    assert torch.all((out - expected).abs() <= bound)

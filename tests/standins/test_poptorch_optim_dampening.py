"""SGD's dampening in the PopTorch stand-in: PopART dampens the first velocity too
(v_1 = (1 - dm) g, ``willow/include/popart/sgd.hpp``), torch does not (v_1 = g); see the comment
on :class:`ipu_standins.poptorch._popart_updates.SGDRule`."""
from __future__ import annotations

from typing import List

import pytest
import torch

import ipu_standins.poptorch as poptorch

U32 = 2.0**-24  # float32 unit roundoff
STEPS = 5
LR, MM = 0.1, 0.9


def _grads() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(6, 5, generator=g) for _ in range(STEPS)]


def _run(opt_cls, dampening: float) -> torch.Tensor:
    w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 30).reshape(6, 5))
    opt = opt_cls([w], lr=LR, momentum=MM, dampening=dampening)
    for g in _grads():
        w.grad = g.clone()
        opt.step()
    return w.detach()


def _tol(w: torch.Tensor) -> float:
    # Each step rounds the velocity (<= 2 roundings of |v| <= sum|g| / (1 - mm)) and the weight
    # (one rounding of |w| and of lr |v|): over STEPS steps, STEPS * 4u * (|w| + 10 max|g|),
    # with a factor 4 for the velocity's roundings carried forward through the momentum.
    big = float(w.abs().max()) + 10.0 * max(float(g.abs().max()) for g in _grads())
    return 4 * STEPS * 4 * U32 * big


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_poptorch_sgd_follows_popart_which_dampens_the_first_velocity(dampening: float) -> None:
    w0 = torch.linspace(-1.0, 1.0, 30).reshape(6, 5).double()
    v = torch.zeros_like(w0)
    w = w0.clone()
    for g in _grads():
        v = MM * v + (1.0 - dampening) * g.double()  # PopART: from v_0 = 0, every step
        w = w - LR * v
    got = _run(poptorch.optim.SGD, dampening)
    assert float((got.double() - w).abs().max()) <= _tol(got)


def test_with_dampening_poptorch_and_torch_differ_by_the_first_step_alone() -> None:
    # torch's v_1 = g_1 against PopART's (1 - dm) g_1: the velocities differ by
    # dm * mm^(t-1) * g_1 at step t, so the weights by lr * dm * g_1 * sum_t mm^(t-1).
    dm = 0.5
    popart = _run(poptorch.optim.SGD, dm)
    reference = _run(torch.optim.SGD, dm)
    g1 = _grads()[0]
    predicted = LR * dm * g1 * sum(MM**t for t in range(STEPS))
    diff = popart - reference
    assert float((diff - predicted).abs().max()) <= 2 * _tol(popart)
    assert float(predicted.abs().max()) > 1000 * _tol(popart)  # far from rounding


def test_without_dampening_poptorch_and_torch_agree_to_rounding() -> None:
    popart = _run(poptorch.optim.SGD, 0.0)
    reference = _run(torch.optim.SGD, 0.0)
    assert float((popart - reference).abs().max()) <= 2 * _tol(popart)


def test_a_training_model_shows_the_same_difference() -> None:
    """Through ``trainingModel`` (a backward pass per step): 5 steps of a linear model, PopTorch's
    SGD against torch's, with and without dampening."""
    def train(make, dampening: float) -> torch.Tensor:
        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 2)
        x = torch.randn(8, 4)
        target = torch.randn(8, 2)

        class _Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = lin

            def forward(self, x, target):
                return poptorch.identity_loss(((self.lin(x) - target) ** 2).mean(),
                                              reduction="none")

        model = _Loss()
        opt = make(model.parameters(), lr=LR, momentum=MM, dampening=dampening)
        if make is torch.optim.SGD:
            for _ in range(STEPS):
                opt.zero_grad()
                model(x, target).backward()
                opt.step()
        else:
            training = poptorch.trainingModel(model, poptorch.Options(), opt)
            for _ in range(STEPS):
                training(x, target)
        return lin.weight.detach().clone()

    same = (train(poptorch.optim.SGD, 0.0) - train(torch.optim.SGD, 0.0)).abs().max()
    damped = (train(poptorch.optim.SGD, 0.5) - train(torch.optim.SGD, 0.5)).abs().max()
    # Without dampening: the same rule, rounding apart (weights and gradients of order one,
    # 5 steps of a few float32 roundings each, and the gradients' own sums of 8 terms).
    assert float(same) <= 100 * STEPS * U32
    # With it, PopART's smaller first velocity moves the weights visibly less far.
    assert float(damped) > 1000 * float(same) + 1e-3

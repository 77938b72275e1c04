"""Automatic loss scaling in the PopTorch stand-in (PopART's AutomaticLossScale transform and
LossScaleUpdate op): the rule on hand-made gradients, then float16 models trained with
``opts.Training.setAutomaticLossScaling(True)`` with each PopTorch optimizer."""
from __future__ import annotations

import math
from typing import List

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._popart_updates import AutoLossScale

EDGE = 65504.0 / 8  # the default bin edge: binEdgeLocation 0.125 of the float16 maximum


def _step(als: AutoLossScale, grads: List[torch.Tensor]) -> float:
    als.observe(grads)
    before = float(als.update_factor)
    als.update()
    return float(als.update_factor) / before


def test_the_factor_doubles_below_the_threshold_and_halves_above_it() -> None:
    # threshold 0.25: halve when upper > (0.25 / 0.75) * lower, i.e. more than 1 in 4 upper.
    als = AutoLossScale(threshold=0.25)
    low, high = torch.full((3,), 1.0).half(), torch.full((1,), EDGE).half()
    assert _step(als, [low, high]) == 2.0  # 1 upper, 3 lower: 1 > 1 is false
    assert _step(als, [low[:2], high]) == 0.5  # 1 upper, 2 lower
    assert _step(als, [low, torch.tensor([EDGE * 0.99]).half()]) == 2.0  # below the edge
    assert float(als.update_factor) == 2.0


def test_infinities_and_nans_count_as_overflow_and_float32_gradients_not_at_all() -> None:
    als = AutoLossScale()
    many = torch.ones(10**6).half()
    assert _step(als, [many, torch.tensor([math.inf]).half()]) == 0.5
    assert _step(als, [many, torch.tensor([math.nan]).half()]) == 0.5
    # float32 gradients do not influence the loss scale (PopART tracks float16 ones).
    assert _step(als, [many, torch.tensor([1e30])]) == 2.0


def test_the_update_period_counts_the_first_step_of_each_period() -> None:
    als = AutoLossScale(period=3)
    overflow = [torch.tensor([math.inf]).half()]
    factors = [_step(als, overflow if i in (1, 2, 4) else [torch.ones(4).half()])
               for i in range(6)]
    # Steps 0 and 3 count and update; the overflows of steps 1, 2 and 4 are not seen.
    assert factors == [2.0, 1.0, 1.0, 2.0, 1.0, 1.0]


def test_each_micro_batch_is_counted_and_the_gradients_still_accumulate() -> None:
    # PopART sums the counts of every micro-batch's gradients over gradient accumulation: one
    # micro-batch past the edge, whose sum with the other would not be, still counts.
    als = AutoLossScale(threshold=0.4)
    w = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    for grad in ([EDGE, 1.0], [-EDGE, 1.0]):
        loss = (w * torch.tensor(grad, dtype=torch.float16)).sum()
        als.backward([w], loss.backward)
    assert w.grad is not None and w.grad.tolist() == [0.0, 2.0]
    assert als.counts == [2, 2]
    als.update()  # 2 upper > (0.4 / 0.6) * 2 lower
    assert float(als.update_factor) == 0.5


@pytest.mark.parametrize("kwargs", [dict(bin_edge=1.5), dict(threshold=-0.1), dict(period=0)])
def test_settings_out_of_range_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="automaticLossScalingSettings"):
        AutoLossScale(**kwargs)


class _Half(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 4).half()
        self.scale = scale  # makes the gradients this large

    def forward(self, x, target):
        out = self.lin(x)
        loss = poptorch.identity_loss(((out.float() - target) ** 2).mean() * self.scale,
                                      reduction="none")
        return out, loss


def _train(optimizer_cls, steps: int, scale: float, initial_ls: float, period: int = 1,
           lr: float = 1e-3, accumulation: int = 1, **kwargs):
    model = _Half(scale)
    opts = poptorch.Options().deviceIterations(steps)
    opts.Training.gradientAccumulation(accumulation)
    opts.Training.setAutomaticLossScaling(True)
    if period != 1:
        opts._Popart.set("automaticLossScalingSettings.updatePeriod", period)
    opts.anchorTensor("ls", "finalLossScale", poptorch.OutputMode.All)
    optimizer = optimizer_cls(model.parameters(), lr=lr, loss_scaling=initial_ls, **kwargs)
    training = poptorch.trainingModel(model, opts, optimizer)
    torch.manual_seed(1)
    x = torch.randn(steps * 2 * accumulation, 8).half()
    target = torch.randn(steps * 2 * accumulation, 4)
    training(x, target)
    # (OutputMode.All of a scalar: one value per step, dimensions of size 1 dropped as PopART
    # drops them)
    scales = training.getAnchoredTensor("ls").reshape(-1).tolist()
    return model, optimizer, training, scales


OPTIMIZERS = [(poptorch.optim.SGD, dict(momentum=0.9, use_combined_accum=False)),
              (poptorch.optim.SGD, {}), (poptorch.optim.Adam, {}), (poptorch.optim.AdamW, {}),
              (poptorch.optim.RMSprop, {}), (poptorch.optim.LAMB, {})]


@pytest.mark.parametrize("optimizer_cls,kwargs", OPTIMIZERS)
def test_a_float16_model_trains_and_its_loss_scale_grows_then_backs_off(optimizer_cls,
                                                                         kwargs) -> None:
    # Gradients of order one: the scale doubles each step until the largest scaled gradient
    # element reaches the bin edge (65504 / 8), then it halves; it stays within a factor of two
    # of that level, far below where float16 gradients overflow.
    model, optimizer, training, scales = _train(optimizer_cls, 24, 1.0, 1.0, **kwargs)
    assert scales[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
    ratios = [b / a for a, b in zip(scales, scales[1:])]
    assert set(ratios) == {2.0, 0.5}
    first_back_off = ratios.index(0.5)
    assert 2.0**8 <= scales[first_back_off] <= 2.0**16
    assert max(scales) <= 2 * scales[first_back_off]
    for p in model.parameters():
        assert p.dtype == torch.float16 and bool(torch.isfinite(p).all())
    state = optimizer.state_dict()
    factor = float(state["ipu_state"]["lossScaleUpdateFactor"])
    assert factor == scales[-1] * ratios[-1]  # the next step's factor, updated after the last
    assert float(state["ipu_param"]["lossScaling_FLOAT"]) == 1.0


def test_the_weights_follow_the_unscaled_gradient_whatever_the_loss_scale() -> None:
    # SGD's update divides by the final loss scale: while no gradient rounds differently in
    # float16, training with ALS ends where training with a constant loss scale of one does.
    opts_free = poptorch.Options().deviceIterations(4)
    model_fixed = _Half(1.0)
    fixed = poptorch.trainingModel(model_fixed, opts_free,
                                   poptorch.optim.SGD(model_fixed.parameters(), lr=0.1))
    model_als, _, _, scales = _train(poptorch.optim.SGD, 4, 1.0, 1.0, lr=0.1)
    torch.manual_seed(1)
    x, target = torch.randn(8, 8).half(), torch.randn(8, 4)
    fixed(x, target)
    assert scales == [1.0, 2.0, 4.0, 8.0]
    # Power-of-two scales are exact in float16 and float32, so the gradients only differ where
    # the unscaled float16 gradient underflowed: none of these are below 2^-14.
    for a, b in zip(model_fixed.parameters(), model_als.parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=2.0**-10, atol=0.0)


def test_large_gradients_make_the_scale_back_off_from_the_first_step() -> None:
    # A loss scale of 2^14 puts gradients of order one past the bin edge (but not past the
    # float16 maximum): the factor halves until they fit below the edge, then grows again.
    model, _, _, scales = _train(poptorch.optim.SGD, 8, 1.0, 2.0**14)
    assert scales[:2] == [2.0**14, 2.0**13]
    ratios = [b / a for a, b in zip(scales, scales[1:])]
    assert 2.0 in ratios
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_an_overflowing_step_backs_off_and_is_applied_as_on_the_ipu() -> None:
    # 2^16 on a loss 64 times larger overflows float16 gradients to infinity: the factor halves
    # for the next step, and the step itself is applied (PopART skips no step), so the weights
    # are no longer finite.
    model, optimizer, _, scales = _train(poptorch.optim.SGD, 1, 64.0, 2.0**16)
    assert scales == [2.0**16]
    assert float(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"]) == 0.5
    assert not all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_update_period_option_is_read(accumulation: int) -> None:
    _, _, _, scales = _train(poptorch.optim.Adam, 6, 1.0, 1.0, period=2,
                             accumulation=accumulation)
    assert scales == [1.0, 2.0, 2.0, 4.0, 4.0, 8.0]


def test_the_update_factor_is_written_with_the_state_and_survives_set_optimizer() -> None:
    model, optimizer, training, scales = _train(poptorch.optim.Adam, 3, 1.0, 1.0)
    assert scales == [1.0, 2.0, 4.0]
    state = optimizer.state_dict()
    state["ipu_state"]["lossScaleUpdateFactor"] = torch.tensor(64.0)
    optimizer.load_state_dict(state)
    x, target = torch.randn(6, 8).half(), torch.randn(6, 4)
    training(x, target)
    assert [float(v) for v in training.getAnchoredTensor("ls")] == [64.0, 128.0, 256.0]
    training.setOptimizer(poptorch.optim.Adam(model.parameters(), lr=1e-4, loss_scaling=1.0))
    training(x, target)
    assert float(training.getAnchoredTensor("ls")[0]) == 512.0


def test_automatic_loss_scaling_without_float16_weights_is_refused() -> None:
    model = torch.nn.Linear(3, 1)
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)

    class _Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, x):
            return poptorch.identity_loss(self.lin(x).sum(), reduction="none")

    training = poptorch.trainingModel(_Loss(), opts, poptorch.optim.SGD(model.parameters(),
                                                                          lr=0.1))
    with pytest.raises(RuntimeError, match="no weight the optimizer trains is float16"):
        training(torch.ones(2, 3))


def test_set_optimizer_keeps_the_loss_scaling_variable_under_automatic_loss_scaling() -> None:
    """PopTorch marks the loss scaling variable whenever automatic loss scaling is on, so an
    optimizer created with the default (constant) loss scaling can be set again after a run,
    as Optimum Graphcore's trainer does each step to pass on the scheduler's learning rate."""
    model = _Half(1.0)
    opts = poptorch.Options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("ls", "finalLossScale", poptorch.OutputMode.All)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=1e-3)
    training = poptorch.trainingModel(model, opts, optimizer)
    x, target = torch.randn(2, 8).half(), torch.randn(2, 4)
    training(x, target)
    first = float(training.getAnchoredTensor("ls").reshape(-1)[0])
    for group in optimizer.param_groups:
        group["lr"] = 5e-4
    training.setOptimizer(optimizer)
    training(x, target)
    # The update factor carries on over the replacement (it doubles on small gradients).
    assert float(training.getAnchoredTensor("ls").reshape(-1)[0]) == 2 * first

"""The PopTorch form of the generic formats' casts (what `transforms.simulate_fp8` puts around
the matmuls): ops PopTorch has, gradients from the forward graph alone."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ipu_unit_scaling.formats import FPFormat
from ipu_unit_scaling.ipu import check_poptorch, ipu_tracing, trace_like_poptorch


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-8, 8, (20000,), generator=g)
    edges = [0.0, -0.0, 1.0, -1.0, 2.0**-9, 2.0**-10, 240.0, 1e6, -1e6, 57344.0,
             2.0**5 * (1 - 2.0**-24), 2.0**-7 * (1 - 2.0**-24), 2.0**-7]
    return torch.cat([spread, torch.tensor(edges)])


@pytest.mark.parametrize("fmt", [FPFormat(4, 3, "nearest"), FPFormat(5, 2, "nearest"),
                                 FPFormat(3, 2, "nearest")], ids=str)
def test_traced_cast_gives_the_eager_casts_values(fmt):
    # Both are exact: a power-of-two spacing and one rounding to an integer step.
    x = _values()
    assert torch.equal(fmt._traced_quantise(x), fmt.quantise(x))


def test_traced_stochastic_cast_lands_on_the_grid_next_to_the_value():
    fmt = FPFormat(4, 3)
    x = _values().clamp(-200, 200)
    got = fmt._traced_quantise(x)
    nearest_grid = FPFormat(4, 3, "nearest")
    assert torch.equal(nearest_grid.quantise(got), got)  # on the grid
    spacing = x.abs() * 2.0**-3 + 2.0**-10  # the grid's step at |x|: 3 mantissa bits
    assert ((got - x).abs() <= spacing).all()


class _Matmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fwd, bwd = FPFormat(4, 3, "nearest"), FPFormat(5, 2, "nearest")
        y = self.linear(fwd.quantise_fwd(x))
        return bwd.quantise_bwd(y).square().mean()


def test_casts_trace_like_poptorch_with_straight_through_gradients():
    model = _Matmul()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = check_poptorch(model, x)  # no frexp or exp2: ops PopTorch has
    assert report.ok
    ops = trace_like_poptorch(model, x).ops()
    assert "ipu_unit_scaling::fp8_quantise_gradient" in ops, ops
    traced = trace_like_poptorch(model, x)(x)
    with ipu_tracing():
        eager = model(x)
    torch.testing.assert_close(traced, eager)
    weight_grad = torch.autograd.grad(traced, model.linear.weight)[0]
    assert weight_grad.abs().sum() > 0  # the cast passes the gradient through


def test_a_gradient_cast_without_an_ipu_format_is_refused_in_one_line():
    with ipu_tracing(), pytest.raises(NotImplementedError, match="E4M3 and E5M2 only"):
        FPFormat(3, 2).quantise_bwd(torch.ones(2))

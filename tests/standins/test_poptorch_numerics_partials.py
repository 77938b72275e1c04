"""Half partials in the PopTorch stand-in (``Precision.setPartialsType(torch.half)``): the
blocked model of float16 accumulation for matmuls and convolutions, against exact sums and an
independent loop, with tolerances from the model's rounding count."""
from __future__ import annotations

import math

import pytest
import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch._numerics import (
    PARTIALS_BLOCK,
    half_partials_convolution,
    half_partials_matmul,
)

U16, U32 = 2.0**-11, 2.0**-24  # unit roundoffs


def _levels(k: int) -> int:
    return math.ceil(math.log2(max(1, -(-k // PARTIALS_BLOCK))))


def _bound(k: int, products_per_block: int) -> float:
    # Each block: a float32 sum of its products (at most products_per_block - 1 roundings) and
    # one float16 rounding; then one float16 rounding per tree level. Each rounding is at most
    # u times the magnitude of what it rounds, itself at most (1 + small) times the sum of the
    # magnitudes of the products below it: per unit of sum |a_i b_i|, (levels + 1) u16 plus
    # products_per_block u32, with 1% for the second-order terms.
    return 1.01 * ((_levels(k) + 1) * U16 + products_per_block * U32)


def _loop_model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The model of the module's docstring, one output element and one addition at a time, in
    Python floats: each block's sum exact (math.fsum), rounded to float16; the block sums added
    pairwise, each sum rounded to float16."""
    def half(value: float) -> float:
        return float(torch.tensor(value, dtype=torch.float64).half())

    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            parts = [half(math.fsum(float(a[i, t]) * float(b[t, j])
                                    for t in range(s, min(s + PARTIALS_BLOCK, k))))
                     for s in range(0, k, PARTIALS_BLOCK)]
            while len(parts) > 1:
                if len(parts) % 2:
                    parts.append(0.0)
                parts = [half(parts[t] + parts[t + 1]) for t in range(0, len(parts), 2)]
            out[i, j] = parts[0]
    return out


@pytest.mark.parametrize("k", [1, 16, 37, 300])
def test_matmul_within_the_model_bound_of_the_exact_and_of_an_independent_loop(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    a = torch.randn(5, k, generator=g).half()
    b = torch.randn(k, 7, generator=g).half()
    got = half_partials_matmul(a, b).double()
    exact = a.double() @ b.double()
    magnitude = a.double().abs() @ b.double().abs()
    assert half_partials_matmul(a, b).dtype == torch.float16
    assert bool(((got - exact).abs() <= _bound(k, PARTIALS_BLOCK) * magnitude).all())
    # The loop differs only by the float32 rounding of the block sums (which may move a
    # float16 rounding by one unit there, and so in each sum above it): twice the bound.
    loop = _loop_model(a, b)
    assert bool(((got - loop).abs() <= 2 * _bound(k, PARTIALS_BLOCK) * magnitude).all())


def test_matmul_half_partials_round_where_float_partials_do_not() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.rand(8, 4096, generator=g).half()
    b = torch.rand(4096, 8, generator=g).half()
    half = half_partials_matmul(a, b)
    single = (a.float() @ b.float()).half()  # float partials: one rounding
    exact = a.double() @ b.double()
    assert bool(((single.double() - exact).abs() <= U16 * exact.abs()).all())
    assert float((half != single).float().mean()) > 0.1  # the extra roundings show


def test_batched_matmul_and_a_transposed_weight_agree_with_one_at_a_time() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 4, 50, generator=g).half()
    w = torch.randn(3, 6, 50, generator=g).half()
    batched = half_partials_matmul(a, w.transpose(-1, -2)).double()
    for i in range(3):
        single = half_partials_matmul(a[i], w[i].t().contiguous()).double()
        magnitude = a[i].double().abs() @ w[i].double().abs().t()
        # Both within the bound of the exact sum, so within twice it of each other.
        assert bool(((batched[i] - single).abs() <= 2 * _bound(50, PARTIALS_BLOCK)
                     * magnitude).all())
        exact = a[i].double() @ w[i].double().t()
        assert bool(((single - exact).abs() <= _bound(50, PARTIALS_BLOCK) * magnitude).all())


@pytest.mark.parametrize("groups,stride,padding,dilation", [(1, 1, 0, 1), (2, 2, 1, 2)])
def test_convolution_within_the_model_bound(groups, stride, padding, dilation) -> None:
    g = torch.Generator().manual_seed(groups)
    x = torch.randn(2, 40, 9, 9, generator=g).half()
    w = torch.randn(6, 40 // groups, 3, 3, generator=g).half()
    args = ([stride] * 2, [padding] * 2, [dilation] * 2, groups)
    got = half_partials_convolution(x, w, *args).double()
    exact = torch.ops.aten.convolution(x.double(), w.double(), None, *args[:3], False, [0, 0],
                                       groups)
    magnitude = torch.ops.aten.convolution(x.double().abs(), w.double().abs(), None,
                                           *args[:3], False, [0, 0], groups)
    bound = _bound(40 // groups, PARTIALS_BLOCK * 9)  # a block: 16 channels x a 3x3 window
    assert bool(((got - exact).abs() <= bound * magnitude).all())


def _conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16),
                               torch.nn.Conv1d(16, 48, 3, padding=1)).half()


def test_set_partials_type_half_reaches_convolutions_and_matmuls() -> None:
    x = torch.randn(2, 16, 16).half()
    outputs = {}
    for ptype in (torch.float, torch.half):
        opts = poptorch.Options()
        opts.Precision.setPartialsType(ptype)
        outputs[ptype] = poptorch.inferenceModel(_conv_model(), opts)(x)
    assert outputs[torch.half].dtype == torch.float16
    assert not torch.equal(outputs[torch.half], outputs[torch.float])
    # Only the convolution's rounding differs once the linear layer's does: the conv alone.
    opts = poptorch.Options()
    opts._Popart.set("convolutionOptions", {"partialsType": "half"})
    conv_only = poptorch.inferenceModel(_conv_model(), opts)(x)
    assert not torch.equal(conv_only, outputs[torch.float])


def test_a_float16_model_with_half_partials_trains() -> None:
    model = _conv_model()

    class _Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return poptorch.identity_loss(self.net(x).float().pow(2).mean(), reduction="none")

    opts = poptorch.Options()
    opts.Precision.setPartialsType(torch.half)
    before = [p.detach().clone() for p in model.parameters()]
    training = poptorch.trainingModel(_Loss(), opts, poptorch.optim.SGD(model.parameters(),
                                                                         lr=0.01))
    loss = training(torch.randn(2, 16, 16).half())
    assert bool(torch.isfinite(loss).all())
    for p, p0 in zip(model.parameters(), before):
        assert p.dtype == torch.float16 and bool(torch.isfinite(p).all())
        assert not torch.equal(p, p0)

"""Half partials (``Precision.setPartialsType(torch.half)``) against a straightforward reference
kept here: a float32 matmul or convolution a block of ``PARTIALS_BLOCK``, each rounded to
float16, and the block sums added pairwise, ``+0`` appended to a level of odd length, each
addition in float32 rounded to float16.

The stand-in's arithmetic is the same; only the float32 sum of a block's products depends on the
kernel's order. So the inputs here are integers times powers of two, nonzero, small enough that
every block's float32 sum is exact in any order: then both sides are fully determined, and
equal bit for bit (NaNs: in the same places). Every float16 rounding is still exercised: the
exact block sums carry up to 24 significant bits, and the scales reach float16's subnormals and
its overflow to infinity.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import pytest
import torch

from ipu_standins.poptorch import _numerics
from ipu_standins.poptorch._numerics import (
    PARTIALS_BLOCK,
    HalfKernels,
    half_partials_convolution,
    half_partials_matmul,
)


def _reference_tree(parts: List[torch.Tensor]) -> torch.Tensor:
    while len(parts) > 1:
        if len(parts) % 2:
            parts.append(torch.zeros_like(parts[0]))
        parts = [(parts[i].float() + parts[i + 1].float()).half()
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _reference_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    k = a.shape[-1]
    return _reference_tree([
        torch.matmul(a[..., s:s + PARTIALS_BLOCK].float(),
                     b[..., s:s + PARTIALS_BLOCK, :].float()).half()
        for s in range(0, k, PARTIALS_BLOCK)])


def _reference_convolution(x: torch.Tensor, w: torch.Tensor, stride: Sequence[int],
                           padding: Sequence[int], dilation: Sequence[int],
                           groups: int) -> torch.Tensor:
    per_group = w.shape[1]
    parts = []
    for s in range(0, per_group, PARTIALS_BLOCK):
        e = min(s + PARTIALS_BLOCK, per_group)
        xs = torch.cat([x[:, g * per_group + s:g * per_group + e] for g in range(groups)], 1)
        parts.append(torch.ops.aten.convolution(
            xs.float(), w[:, s:e].float(), None, stride, padding, dilation, False,
            [0] * (w.dim() - 2), groups).half())
    return _reference_tree(parts)


def _exact(shape: Sequence[int], magnitude: int, scales: torch.Tensor,
           g: torch.Generator) -> torch.Tensor:
    """Float16 nonzero integers in [-magnitude, magnitude] times ``2 ** scales`` (broadcast)."""
    values = torch.randint(1, magnitude + 1, tuple(shape), generator=g)
    signs = torch.randint(0, 2, tuple(shape), generator=g) * 2 - 1
    return (values * signs * torch.pow(2.0, scales.double())).half()


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN need only meet a NaN (its payload is not modelled)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    nan = torch.isnan(want)
    return bool(torch.equal(torch.isnan(got), nan)) and bool(torch.equal(
        got[~nan].view(torch.int16), want[~nan].view(torch.int16)))


def _matmul_operands(batch: Sequence[int], m: int, k: int, n: int, seed: int,
                     wide: bool = False) -> Any:
    """Nonzero integers up to 2**10 times 2**(scale - 10), a scale a row of ``a`` and a column
    of ``b``: each product up to 2**20 units of its row's and column's, a block's 16 summed
    exactly in float32. Scales from -14 to 7 (``wide``): block sums from below float16's
    subnormals to past its largest finite value; else from -6 to 1."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-14, 7) if wide else (-6, 1)
    row = torch.randint(low, high + 1, (*batch, m, 1), generator=g)
    col = torch.randint(low, high + 1, (*batch, 1, n), generator=g)
    return (_exact((*batch, m, k), 1 << 10, row - 10, g),
            _exact((*batch, k, n), 1 << 10, col - 10, g))


MATMULS = [
    ((), 5, 1, 7), ((), 5, 16, 7), ((), 6, 37, 9), ((), 8, 48, 3), ((), 7, 80, 5),
    ((), 9, 112, 4), ((), 33, 1024, 17), ((), 4, 4096, 4), ((3,), 4, 50, 6),
    ((32,), 16, 128, 16), ((2, 3), 7, 80, 5),
]


@pytest.mark.parametrize("batch,m,k,n", MATMULS)
def test_matmul_equals_the_reference_bit_for_bit(batch, m, k, n) -> None:
    a, b = _matmul_operands(batch, m, k, n, seed=k + m)
    assert _same(half_partials_matmul(a, b), _reference_matmul(a, b))


@pytest.mark.parametrize("batch,m,k,n", MATMULS)
def test_transposed_operands_as_a_backward_pass_gives_them(batch, m, k, n) -> None:
    a, b = _matmul_operands(batch, m, k, n, seed=2 * k + m)
    # [..., k, m] and [..., n, k] laid out, read transposed: the saved activation and weight.
    at = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    bt = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert _same(half_partials_matmul(at, bt), _reference_matmul(a, b))


def test_subnormals_overflow_and_infinities_round_as_the_reference() -> None:
    a, b = _matmul_operands((), 40, 300, 30, seed=3, wide=True)
    a[0, 5], a[1, 7], a[1, 200] = float("inf"), float("-inf"), float("inf")
    want = _reference_matmul(a, b)
    assert bool(torch.isinf(want).any()) and bool(torch.isnan(want).any())
    finite = want[torch.isfinite(want)].float().abs()
    assert bool((finite[finite > 0] < 2.0**-14).any())  # subnormal results
    assert bool((want == 0).any())  # and results that underflow to zero
    assert _same(half_partials_matmul(a, b), want)


def test_the_block_sums_of_many_tiles_give_the_same_bits(monkeypatch) -> None:
    a, b = _matmul_operands((), 37, 300, 29, seed=4)
    batched = _matmul_operands((5,), 37, 100, 3, seed=5)
    whole, whole_batched = half_partials_matmul(a, b), half_partials_matmul(*batched)
    # 19 blocks of 29 float32 sums a row: 5 rows a tile (7 tiles and 2 rows); batched, 2 tiles
    monkeypatch.setattr(_numerics, "_TILE_BYTES", 4 * 19 * 29 * 5)
    assert _same(half_partials_matmul(a, b), whole)
    assert _same(half_partials_matmul(a, b), _reference_matmul(a, b))
    assert _same(half_partials_matmul(*batched), whole_batched)
    assert _same(half_partials_matmul(*batched), _reference_matmul(*batched))


def test_broadcast_batch_dims_and_an_empty_reduction() -> None:
    a, b = _matmul_operands((2, 1), 4, 40, 3, seed=6)
    _, b3 = _matmul_operands((3,), 40, 40, 3, seed=7)
    b3 = b3[:, :40]
    want = _reference_matmul(a.expand(2, 3, 4, 40), b3.expand(2, 3, 40, 3))
    assert _same(half_partials_matmul(a, b3), want)
    empty = half_partials_matmul(torch.ones(3, 0).half(), torch.ones(0, 2).half())
    assert empty.dtype == torch.float16 and torch.equal(empty, torch.zeros(3, 2).half())


CONVOLUTIONS = [
    # (x shape, weight shape, groups, stride, padding, dilation)
    ((2, 3, 9, 9), (5, 3, 3, 3), 1, 1, 1, 1),
    ((2, 40, 9, 9), (6, 40, 3, 3), 1, 1, 0, 1),
    ((2, 40, 9, 9), (6, 20, 3, 3), 2, 2, 1, 2),
    ((3, 64, 8, 8), (16, 64, 3, 3), 1, 1, 1, 1),
    ((2, 96, 12), (8, 48, 5), 2, 1, 2, 1),
    ((2, 8, 6, 6), (8, 1, 3, 3), 8, 1, 1, 1),
]


@pytest.mark.parametrize("xs,ws,groups,stride,padding,dilation", CONVOLUTIONS)
def test_convolution_equals_the_reference_bit_for_bit(xs, ws, groups, stride, padding,
                                                      dilation) -> None:
    # Integers up to 2**7: 16 channels x a 5-wide or 3x3 window of products up to 2**14 sum
    # exactly in float32 (at most 144 * 2**14 < 2**24).
    g = torch.Generator().manual_seed(sum(xs) + groups)
    dims = len(xs) - 2
    x = _exact(xs, 1 << 7, torch.randint(-8, 1, (xs[0], 1) + (1,) * dims, generator=g) - 4, g)
    w = _exact(ws, 1 << 7, torch.randint(-4, 1, (ws[0], 1) + (1,) * dims, generator=g) - 4, g)
    args = ([stride] * dims, [padding] * dims, [dilation] * dims, groups)
    want = _reference_convolution(x, w, *args)
    assert _same(half_partials_convolution(x, w, *args), want)


class _CountingHalfKernels(HalfKernels):
    def __init__(self) -> None:
        super().__init__()
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[dict] = None) -> Any:
        self.ops.append(str(func))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_half_partials_run_outside_the_half_kernels_mode_with_the_same_bits() -> None:
    """Every op of the half partials has a CPU kernel: under :class:`HalfKernels` (which the
    executor enters for float16 models) none of them pays its Python call per op."""
    a, b = _matmul_operands((), 64, 256, 64, seed=8)
    x = _exact((2, 40, 6, 6), 1 << 7, torch.tensor(-6), torch.Generator().manual_seed(9))
    w = _exact((4, 40, 3, 3), 1 << 7, torch.tensor(-6), torch.Generator().manual_seed(10))
    conv_args = ([1, 1], [1, 1], [1, 1], 1)
    mode = _CountingHalfKernels()
    with mode:
        product = half_partials_matmul(a, b)
        convolved = half_partials_convolution(x, w, *conv_args)
    assert mode.ops == []
    assert _same(product, _reference_matmul(a, b))
    assert _same(convolved, _reference_convolution(x, w, *conv_args))


def test_the_backward_pass_computes_only_the_gradients_asked_for() -> None:
    a, b = _matmul_operands((), 8, 64, 8, seed=11)
    grad = _matmul_operands((), 8, 8, 8, seed=12)[0]
    weight = b.clone().requires_grad_()
    out = _numerics._HalfMatmul.apply(a, weight)
    (found,) = torch.autograd.grad(out, weight, grad)
    assert _same(found, _reference_matmul(a.t(), grad))
    mode = _CountingHalfKernels()
    with mode:  # the input's gradient is not asked for: no matmul for it either
        out = _numerics._HalfMatmul.apply(a, weight)
        torch.autograd.grad(out, weight, grad)
    assert not any("mm" in op for op in mode.ops), mode.ops


def test_without_float16_additions_the_tree_adds_in_float32_to_the_same_bits(monkeypatch):
    """Torch builds without a float16 addition on the CPU: each addition in float32, rounded
    to float16, the same correctly rounded sum."""
    a, b = _matmul_operands((), 40, 300, 30, seed=13, wide=True)
    batched = _matmul_operands((4,), 9, 130, 5, seed=14)
    x = _exact((2, 40, 6, 6), 1 << 7, torch.tensor(-6), torch.Generator().manual_seed(15))
    w = _exact((4, 40, 3, 3), 1 << 7, torch.tensor(-6), torch.Generator().manual_seed(16))
    conv_args = ([1, 1], [1, 1], [1, 1], 1)
    monkeypatch.setattr(_numerics, "_ADDS_FLOAT16", False)
    assert _same(half_partials_matmul(a, b), _reference_matmul(a, b))
    assert _same(half_partials_matmul(*batched), _reference_matmul(*batched))
    assert _same(half_partials_convolution(x, w, *conv_args),
                 _reference_convolution(x, w, *conv_args))

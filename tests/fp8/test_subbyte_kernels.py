"""The host library's casts to FP4 and FP6 elements (`ius_nvfp4_quantise`,
`ius_mx_subbyte_quantise`): hand-worked cases, and group_cast's host path against its torch
path bit for bit (values and scales), over ragged shapes, every grouping, transposed operands
and the edge values. Its divisions, products and
maxima are correctly rounded IEEE operations on every CPU, so bit equality holds whatever
kernels torch picks."""
from __future__ import annotations

import pytest
import torch
from test_host_library_groups import SHAPES, edge_tensor

from ipu_unit_scaling.fp8 import NonFiniteAmaxError, get_format
from ipu_unit_scaling.fp8 import host_library as _host
from ipu_unit_scaling.fp8.group_cast import Grouping, group_cast

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("host_library")]

E2M1 = get_format("E2M1")
GROUPINGS = [Grouping("tile", 16), Grouping("tile", 7), Grouping("block", 16), Grouping("row"),
             Grouping("tensor")]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_a_hand_worked_cast():
    # amax 2688 = 6 * 448 gives a tensor scale of 1. The first block's E4M3 scale is
    # 2688 / 6 = 448: 2688 decodes as itself and 1 / 448 rounds to zero. The second block's
    # is E4M3(3 / 6) = 0.5: 3, 1.3, 0.6 and -0.2 are 6, 2.6, 1.2 and -0.4 at that scale,
    # which E2M1 rounds to 6, 3, 1 and -0.5, so they decode as 3, 1.5, 0.5 and -0.25.
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([2688.0, 1.0])
    x[0, 16:20] = torch.tensor([3.0, 1.3, 0.6, -0.2])
    values, block_scales, tensor_scale = _host.nvfp4_quantise(x, 1, 16)
    expected = torch.zeros(1, 32)
    expected[0, 0] = 2688.0
    expected[0, 16:20] = torch.tensor([3.0, 1.5, 0.5, -0.25])
    assert tensor_scale == 1.0
    assert block_scales.tolist() == [[448.0, 0.5]]
    assert torch.equal(values, expected)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("grouping", GROUPINGS, ids=lambda g: f"{g.kind}{g.size or ''}")
@pytest.mark.parametrize("transposed", [False, True], ids=["operand", "transposed"])
def test_the_host_cast_is_the_torch_paths_bit_for_bit(shape, grouping, transposed,
                                                      monkeypatch):
    x = edge_tensor(*shape, seed=sum(shape))
    x[torch.rand(shape, generator=torch.Generator().manual_seed(3)) < 0.1] = -0.0
    operand = x.t() if transposed else x
    calls = []
    kernel = _host.nvfp4_quantise
    monkeypatch.setattr(_host, "nvfp4_quantise", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    host = group_cast(operand, E2M1, grouping, rule="nvfp4")
    assert calls == [1]  # the kernel made it
    with _host.disabled():
        reference = group_cast(operand, E2M1, grouping, rule="nvfp4")
    assert torch.equal(bits(host.values), bits(reference.values))
    assert host.block_scales is not None and reference.block_scales is not None
    assert host.block_scales.shape == reference.block_scales.shape
    assert torch.equal(bits(host.block_scales), bits(reference.block_scales))
    assert host.tensor_scale == reference.tensor_scale


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e4, 1e30])
def test_every_e2m1_tie_and_magnitude_matches_the_torch_path(scale):
    # Ties of E2M1's grid (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) and values past its max, at
    # magnitudes where the tensor scale is subnormal-free and where it is tiny or huge.
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, 6.0, 0.1, 0.3, 0.5])
    x = torch.cat([grid, -grid, torch.randn(40, generator=torch.Generator().manual_seed(0))])
    x = (x * scale).reshape(4, 16)
    host = group_cast(x, E2M1, Grouping("tile", 16), rule="nvfp4")
    with _host.disabled():
        reference = group_cast(x, E2M1, Grouping("tile", 16), rule="nvfp4")
    assert torch.equal(bits(host.values), bits(reference.values))


def test_the_kernel_writes_over_its_input_with_the_same_values():
    x = edge_tensor(33, 48, seed=5)
    expected = _host.nvfp4_quantise(x.clone(), 1, 16)[0]
    got = _host.nvfp4_quantise(x, 1, 16, out=x)[0]
    assert got.data_ptr() == x.data_ptr()
    assert torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_tensor_is_refused_and_group_cast_names_it(bad):
    x = torch.randn(4, 32)
    x[2, 5] = bad
    before = x.clone()
    out = torch.full_like(x, 7.0)
    assert _host.nvfp4_quantise(x, 1, 16, out=out) is None
    assert torch.equal(out, torch.full_like(x, 7.0))  # nothing written
    assert torch.equal(bits(x), bits(before))
    with pytest.raises(NonFiniteAmaxError):
        group_cast(x, E2M1, Grouping("tile", 16), rule="nvfp4")


def test_a_tensor_scale_that_underflows_takes_the_torch_path():
    # amax / 2688 is 0 in float32: the kernel refuses, and group_cast gives the torch path's
    # result (every value rounds to zero).
    x = torch.full((2, 16), 1e-44)
    assert _host.nvfp4_quantise(x, 1, 16) is None
    host = group_cast(x, E2M1, Grouping("tile", 16), rule="nvfp4")
    with _host.disabled():
        reference = group_cast(x, E2M1, Grouping("tile", 16), rule="nvfp4")
    assert torch.equal(bits(host.values), bits(reference.values))
    assert not host.values.any()


SUBBYTE = ["E2M1", "E2M3", "E3M2"]


def test_a_hand_worked_mx_fp4_cast():
    # A group of amax 5: floor(log2 5) = 2 = E2M1's emax, so e = 0 and the elements round on
    # E2M1's own grid: 5 is a tie between 4 and 6 and goes to 4 (even), 1.25 to 1, 0.3 to 0.5.
    # Rounding up asks for 5 <= 6 * 2**e: also e = 0. A group of amax 96: e = 6 - 2 = 4, so
    # 96 / 16 = 6 and 20 / 16 = 1.25, which rounds to 1 and decodes as 16.
    fmt = get_format("E2M1")
    x = torch.tensor([[5.0, 1.25, -0.3, 0.0, 96.0, 20.0, 0.0, 0.0]])
    for round_up in (False, True):
        values, scales = _host.mx_subbyte_quantise(x, 1, 4, fmt.mantissa_bits, fmt.min_exponent,
                                                   fmt.max, fmt.max_exponent, round_up)
        assert scales.tolist() == [[0, -4]]
        assert values.tolist() == [[4.0, 1.0, -0.5, 0.0, 96.0, 16.0, 0.0, 0.0]]


@pytest.mark.parametrize("fmt_name", SUBBYTE)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("grouping", GROUPINGS, ids=lambda g: f"{g.kind}{g.size or ''}")
@pytest.mark.parametrize("scale_rounding", ["floor", "up"])
def test_the_mx_subbyte_host_cast_is_the_torch_paths_bit_for_bit(fmt_name, shape, grouping,
                                                                 scale_rounding, monkeypatch):
    fmt = get_format(fmt_name)
    x = edge_tensor(*shape, seed=sum(shape))
    calls = []
    kernel = _host.mx_subbyte_quantise
    monkeypatch.setattr(_host, "mx_subbyte_quantise",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for operand in (x, x.t()):
        calls.clear()
        host = group_cast(operand, fmt, grouping, rule="mx", scale_rounding=scale_rounding)
        assert calls == [1]  # the kernel made it
        with _host.disabled():
            reference = group_cast(operand, fmt, grouping, rule="mx",
                                   scale_rounding=scale_rounding)
        assert torch.equal(bits(host.values), bits(reference.values))
        assert host.log2_scales is not None and reference.log2_scales is not None
        assert host.log2_scales.shape == reference.log2_scales.shape
        assert torch.equal(host.log2_scales, reference.log2_scales)


@pytest.mark.parametrize("fmt_name", SUBBYTE)
def test_every_subbyte_value_and_tie_matches_the_torch_path(fmt_name):
    # Every value of the format and every midpoint between neighbours, both signs, in one
    # group whose amax is the format's max (so e = 0 under the floor rule), and the same
    # scaled by 2**-130 (subnormal float32 products) and 2**100.
    fmt = get_format(fmt_name)
    grid = torch.tensor(sorted({abs(v) for v in fmt.values}), dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    row = torch.cat([grid, mids, -grid, -mids])
    for power in (0, -130, 100):
        x = (row * 2.0 ** power).reshape(1, -1)
        host = group_cast(x, fmt, Grouping("row"), rule="mx")
        with _host.disabled():
            reference = group_cast(x, fmt, Grouping("row"), rule="mx")
        assert torch.equal(bits(host.values), bits(reference.values))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_mx_subbyte_group_is_refused_and_named(bad):
    fmt = get_format("E2M1")
    x = torch.randn(4, 64)
    x[3, 40] = bad
    out = torch.full_like(x, 7.0)
    assert _host.mx_subbyte_quantise(x, 1, 32, fmt.mantissa_bits, fmt.min_exponent, fmt.max,
                                     fmt.max_exponent, out=out) is None
    assert torch.equal(out, torch.full_like(x, 7.0))  # nothing written
    with pytest.raises(NonFiniteAmaxError, match=r"\(3, 1, 0\)"):
        group_cast(x, fmt, Grouping("tile", 32), rule="mx")

"""The host library's NVFP4 cast (`ius_nvfp4_quantise`): a hand-worked case, and group_cast's
host path against its torch path bit for bit (values, block scales, tensor scale), over ragged
shapes, every grouping, transposed operands and the edge values. Its divisions, products and
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

"""The grouped-recipe codelets run tile by tile: bit for bit group_cast's values and scales."""
from __future__ import annotations

import itertools
from typing import Tuple

import pytest
import torch

from ipu_unit_scaling.fp8 import NonFiniteAmaxError, get_format
from ipu_unit_scaling.fp8 import codelet_blocks as blocks
from ipu_unit_scaling.fp8 import host_library as _host
from ipu_unit_scaling.fp8.group_cast import Grouping, group_cast

pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("host_library")]

# (format, rule, scale rounding, overflow): the recipes' casts the IPU path takes
CASTS = [("F143", "amax", "floor", "saturate"), ("F152", "amax", "floor", "saturate"),
         ("F143", "amax", "floor", "nan"), ("F152", "amax", "floor", "nan"),
         ("E4M3FN", "amax", "floor", "saturate"), ("E4M3FN", "mx", "floor", "saturate"),
         ("E5M2", "mx", "floor", "saturate"), ("E4M3FN", "mx", "up", "saturate"),
         ("F143", "mx", "floor", "saturate")]
GROUPINGS = [Grouping("row"), Grouping("tile", 128), Grouping("tile", 32),
             Grouping("block", 128), Grouping("block", 5)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns, every NaN as one pattern (NaN payloads are not compared)."""
    t = t.to(torch.float32)
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def _wide(shape: Tuple[int, int], seed: int) -> torch.Tensor:
    """Normal samples over ~80 binades (float32 subnormals to 2**40), with exact zeros."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    x = x * torch.exp2(torch.randint(-140, 40, shape, generator=generator).float())
    return x.masked_fill(torch.rand(shape, generator=generator) < 0.05, 0.0)


def _reference(x: torch.Tensor, fmt: str, grouping: Grouping, rule: str, rounding: str,
               overflow: str, margin: int = 0):  # type: ignore[no-untyped-def]
    return group_cast(x.to(torch.float32), get_format(fmt), grouping, rule=rule, margin=margin,
                      overflow=overflow, scale_rounding=rounding)


def _assert_matches(x, cast, grouping, tiles, workers, margin=0, dtype=None):  # type: ignore[no-untyped-def]
    fmt, rule, rounding, overflow = cast
    ref = _reference(x, fmt, grouping, rule, rounding, overflow, margin)
    got = blocks.group_quantise_graph(x, fmt, grouping, rule, margin, overflow, rounding,
                                      tiles=tiles, workers=workers)
    assert torch.equal(got.log2_scales, ref.log2_scales), (cast, grouping)
    assert not bool(got.non_finite.any())
    expected = ref.values.to(x.dtype)  # one rounding of the exact float32 value to float16
    codes = got.codes
    if fmt in ("E4M3FN", "E5M2"):
        # The vertices hold OCP elements on the IPU's grid, which has no negative zero: a
        # negative value that flushes is +0 there and -0 in the OCP format (+ 0.0 makes -0 +0).
        codes, expected = codes + 0.0, expected + 0.0
    assert torch.equal(_bits(codes), _bits(expected)), (cast, grouping, tiles, workers)


@pytest.mark.parametrize("cast", CASTS, ids=["-".join(c) for c in CASTS])
def test_random_shapes_match_group_cast_bit_for_bit(cast):
    generator = torch.Generator().manual_seed(len(cast[0]) + len(cast[1]))
    for trial, grouping in enumerate(GROUPINGS):
        rows, cols = (int(n) for n in torch.randint(1, 300, (2,), generator=generator))
        tiles, workers = [(1, 1), (7, 6), (1472, 6), (3, 4), (1472, 1)][trial]
        margin = 0 if cast[1] == "mx" else trial % 4
        _assert_matches(_wide((rows, cols), trial), cast, grouping, tiles, workers, margin)


@pytest.mark.parametrize("grouping", GROUPINGS, ids=str)
def test_float16_inputs_and_ragged_blocks(grouping):
    x = (torch.randn(131, 261) * 300).to(torch.float16)
    x[0, :7] = torch.tensor([6.0e-8, -6.0e-8, 65504.0, -65504.0, 1e-5, 0.0, -0.0],
                            dtype=torch.float16)  # float16 subnormals and its max
    for cast in [CASTS[0], CASTS[1], CASTS[5], CASTS[6]]:
        _assert_matches(x, cast, grouping, tiles=16, workers=6)


def test_zeros_and_float32_subnormal_groups():
    x = torch.zeros(3, 96)
    x[1, 32:64] = torch.tensor(2.0 ** -149) * torch.arange(32)  # a group of subnormals only
    x[2, :32] = torch.tensor(2.0 ** -130)
    x[2, 64:] = torch.randn(32) * 2.0 ** -126
    for cast, grouping in itertools.product(CASTS, [Grouping("tile", 32), Grouping("row")]):
        _assert_matches(x, cast, grouping, tiles=5, workers=6)
    mx = blocks.group_quantise_graph(torch.zeros(2, 64), "E4M3FN", Grouping("tile", 32), "mx")
    assert mx.log2_scales.flatten().tolist() == [127] * 4  # E8M0's smallest, e = -127
    empty = blocks.group_quantise_graph(torch.zeros(3, 0), "F143", Grouping("row"))
    assert empty.codes.shape == (3, 0) and empty.log2_scales.tolist() == [[0]] * 3


def test_non_finite_groups_are_flagged_with_scale_zero_and_the_rest_is_group_cast():
    x = torch.randn(4, 100)
    x[1, 40] = float("inf")
    x[3, 99] = float("nan")
    grouping = Grouping("tile", 32)
    with pytest.raises(NonFiniteAmaxError, match=r"\(1, 1, 0\)"):
        group_cast(x, get_format("F143"), grouping)
    got = blocks.group_quantise_graph(x, "F143", grouping, tiles=3)
    bad = torch.zeros(4, 4, 1, dtype=torch.bool)
    bad[1, 1], bad[3, 3] = True, True
    assert torch.equal(got.non_finite, bad)
    assert got.log2_scales[bad].tolist() == [0, 0]
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    ref = group_cast(clean, get_format("F143"), grouping)
    elements = bad.squeeze(-1).repeat_interleave(32, dim=1)[:, :100]
    assert torch.equal(_bits(got.codes)[~elements], _bits(ref.values)[~elements])
    assert torch.equal(got.log2_scales[~bad], ref.log2_scales[~bad])
    # s = 0 in a flagged group: inf saturates, NaN stays NaN
    assert got.codes[1, 40] == 240.0 and torch.isnan(got.codes[3, 99])


def test_codes_round_trip_through_the_decode_vertex_in_float16():
    x = torch.randn(40, 70)
    grouping = Grouping("block", 16)
    cast = blocks.group_cast_to_fp8_vertices(x, "E5M2", grouping, "mx", tiles=9)
    ref = group_cast(x, get_format("E5M2"), grouping, rule="mx")
    half = blocks.group_cast_from_fp8_vertices(cast.codes, cast.log2_scales, "E5M2", grouping,
                                               torch.float16, tiles=9)
    assert torch.equal(_bits(half), _bits(ref.values.to(torch.float16)))


def test_layout_covers_every_element_once_and_tiles_get_whole_groups():
    for grouping in GROUPINGS:
        layout = blocks.group_layout(37, 290, grouping)
        covered = torch.zeros(37 * 290, dtype=torch.int64)
        for start, length in zip(layout.starts.tolist(), layout.lengths.tolist()):
            covered[start:start + length] += 1
        assert bool((covered == 1).all()), grouping
        assert layout.groups == int(torch.tensor(layout.scale_shape).prod())
    assert blocks.deal_groups(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert blocks.deal_groups(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for groups, tiles in [(10, 4), (131072, 1472), (5, 1472)]:  # splitRange, grain 1
        bounds = _host.partition(groups * 8, tiles, 1).reshape(tiles, 2) // 8
        assert blocks.deal_groups(groups, tiles) == [tuple(b) for b in bounds.tolist()]


@pytest.mark.parametrize("arguments,message", [
    (("E2M1", Grouping("tile", 32), "mx"), "take F143, F152, E4M3FN, E5M2 elements, not E2M1"),
    (("F143", Grouping("tile", 32), "nvfp4"), "rule 'amax'"),
    (("E4M3FN", Grouping("tile", 32), "mx", 0, "nan"), "saturate"),
    (("F143", Grouping("tensor")), "per-tensor Fp8Quantise op"),
    (("F143", Grouping("row"), "amax", 40), "margin"),
])
def test_bad_arguments_get_one_line(arguments, message):
    with pytest.raises(ValueError, match=message) as error:
        blocks.group_cast_to_fp8_vertices(torch.ones(2, 64), *arguments)
    assert "\n" not in str(error.value)


def test_the_torch_library_op_is_one_node_with_a_straight_through_gradient():
    from torch.fx.experimental.proxy_tensor import make_fx

    grouping = Grouping("tile", 32)
    x = torch.randn(6, 80, requires_grad=True)
    values, scales, flags = blocks.fp8_group_quantise(x, "E4M3FN", grouping, "mx")
    ref = group_cast(x.detach(), get_format("E4M3FN"), grouping, rule="mx")
    assert torch.equal(_bits(values), _bits(ref.values))
    assert torch.equal(scales, ref.log2_scales) and flags.dtype == torch.int32
    dy = torch.randn(6, 80)
    values.backward(dy)
    assert torch.equal(x.grad, dy)
    graph = make_fx(lambda t: blocks.fp8_group_quantise(t, "F143", grouping),
                    tracing_mode="fake")(torch.randn(6, 80))
    calls = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert sum("fp8_group_quantise" in str(c) for c in calls) == 1
    shapes = [n.meta["val"].shape for n in graph.graph.nodes if n.op == "call_function"
              and "getitem" in str(n.target)]
    assert torch.Size([6, 3, 1]) in shapes

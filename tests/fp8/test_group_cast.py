"""The grouped cast against independent references: gfloat's MX block quantiser, ml_dtypes'
element rounding, an NVFP4 quantiser written on gfloat, and the package's own per-tensor AMAX
cast applied to each row, tile and block."""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from recipe_references import (
    ML_ELEMENTS,
    MX_NAMES,
    gfloat_mx,
    gfloat_nvfp4,
    per_tensor_reference,
    wide_tensor,
)

from ipu_unit_scaling.fp8 import (
    NonFiniteAmaxError,
    fp8_stats,
    get_format,
    log2_scale,
)
from ipu_unit_scaling.fp8.group_cast import (
    Grouping,
    group_cast,
    group_log2_scales,
    mx_shared_exponents,
)

pytestmark = pytest.mark.numerics

shapes = st.tuples(st.integers(1, 6), st.integers(1, 100))


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), name=st.sampled_from(sorted(MX_NAMES)))
def test_mx_matches_gfloat_block_quantiser(shape, seed, name):
    x = wide_tensor(*shape, seed)
    ours = group_cast(x, get_format(name), Grouping("tile", 32), rule="mx").values
    np.testing.assert_array_equal(ours.double().numpy(), gfloat_mx(x, name))


def smallest_unsaturating_exponent(amax: float, fmt_max: float) -> int:
    """The least e with amax <= fmt_max * 2**e, by exact rational search."""
    ratio = Fraction(amax) / Fraction(fmt_max)
    e = 0
    while Fraction(2) ** e < ratio:
        e += 1
    while Fraction(2) ** (e - 1) >= ratio:
        e -= 1
    return e


@pytest.mark.parametrize("name", sorted(MX_NAMES))
def test_mx_round_up_scales_never_saturate_and_elements_match_ml_dtypes(name):
    dtype = getattr(ml_dtypes, ML_ELEMENTS[name], None)
    if dtype is None:
        pytest.skip(f"this ml_dtypes has no {ML_ELEMENTS[name]}")
    fmt = get_format(name)
    x = wide_tensor(4, 96, seed=7)
    x[2, :32] = fmt.max * 2.0**-3  # amax exactly max * 2**e: the scale needs no rounding up
    cast = group_cast(x, fmt, Grouping("tile", 32), rule="mx", scale_rounding="up")
    expected = np.zeros((4, 96))
    for r in range(4):
        for b in range(3):
            block = x[r, 32 * b:32 * (b + 1)].double().numpy()
            amax = float(np.abs(block).max())
            e = -127 if amax == 0 else max(-127, smallest_unsaturating_exponent(amax, fmt.max))
            assert int(-cast.log2_scales[r, b, 0]) == e
            scaled = block / 2.0**e
            assert np.abs(scaled).max() <= fmt.max
            expected[r, 32 * b:32 * (b + 1)] = (
                scaled.astype(np.float32).astype(dtype).astype(np.float64) * 2.0**e)
    np.testing.assert_array_equal(cast.values.double().numpy(), expected)


def test_mx_scale_codes_are_e8m0():
    """The shared exponents encode as E8M0 bytes (``e + 127``), as ml_dtypes encodes 2**e."""
    if not hasattr(ml_dtypes, "float8_e8m0fnu"):
        pytest.skip("this ml_dtypes has no float8_e8m0fnu")
    amax = torch.tensor([0.0, 3e-39, 1e-30, 0.75, 1.0, 448.0, 500.0, 3.0e38])
    exponents = mx_shared_exponents(amax, get_format("E4M3FN"))
    powers = np.exp2(exponents.double().numpy())
    codes = powers.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    np.testing.assert_array_equal(codes, (exponents + 127).numpy().astype(np.uint8))
    # floor(log2(amax)) - 8 for E4M3 (emax 8), clamped to -127; zero amax gives -127.
    assert exponents.tolist() == [-127, -127, -108, -9, -8, 0, 0, 119]


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), margin=st.integers(0, 4),
       name=st.sampled_from(["F143", "F152", "E4M3FN", "E5M2"]),
       grouping=st.sampled_from([Grouping("row"), Grouping("tile", 16), Grouping("tile", 128),
                                 Grouping("block", 4), Grouping("block", 128),
                                 Grouping("tensor")]))
def test_amax_groups_match_the_per_tensor_cast_of_each_group(shape, seed, margin, name,
                                                            grouping):
    fmt = get_format(name)
    x = wide_tensor(*shape, seed, spread=40)
    ours = group_cast(x, fmt, grouping, margin=margin).values
    rows, cols = shape
    expected = torch.empty_like(x)
    if grouping.kind == "tensor":
        expected = per_tensor_reference(x, fmt, margin)
    elif grouping.kind == "row":
        for r in range(rows):
            expected[r] = per_tensor_reference(x[r], fmt, margin)
    elif grouping.kind == "tile":
        size = grouping.size
        for r in range(rows):
            for c in range(0, cols, size):
                expected[r, c:c + size] = per_tensor_reference(x[r, c:c + size], fmt, margin)
    else:
        size = grouping.size
        for r in range(0, rows, size):
            for c in range(0, cols, size):
                expected[r:r + size, c:c + size] = per_tensor_reference(
                    x[r:r + size, c:c + size], fmt, margin)
    assert torch.equal(ours, expected)


@settings(max_examples=300, deadline=None)
@given(amax=st.one_of(st.just(0.0), st.floats(min_value=2.0**-149, max_value=2.0**127, width=32)),
       name=st.sampled_from(["F143", "F152", "E4M3FN", "E5M2", "E2M1"]),
       margin=st.integers(0, 31))
def test_vectorised_amax_rule_is_the_scalar_rule(amax, name, margin):
    scales = group_log2_scales(torch.tensor([amax]), get_format(name), margin)
    assert int(scales[0]) == log2_scale(amax, name, margin)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_nvfp4_matches_a_gfloat_reference(shape, seed):
    x = wide_tensor(*shape, seed, spread=6)
    ours = group_cast(x, get_format("E2M1"), Grouping("tile", 16), rule="nvfp4")
    np.testing.assert_array_equal(ours.values.numpy(), gfloat_nvfp4(x))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("rule,grouping,name,overflow", [
    ("amax", Grouping("row"), "F143", "saturate"), ("amax", Grouping("row"), "F143", "nan"),
    ("amax", Grouping("tile", 128), "E4M3FN", "saturate"),
    ("amax", Grouping("tile", 128), "E4M3FN", "nan"),
    ("amax", Grouping("block", 128), "F152", "saturate"),
    ("amax", Grouping("block", 128), "F152", "nan"),
    # mx and nvfp4 saturate (FP8Config refuses overflow "nan" for them)
    ("mx", Grouping("tile", 32), "E4M3FN", "saturate"),
    ("nvfp4", Grouping("tile", 16), "E2M1", "saturate"),
])
def test_a_non_finite_group_is_one_clear_error(overflow, bad, rule, grouping, name):
    x = torch.randn(3, 200)
    x[1, 150] = bad
    with pytest.raises(NonFiniteAmaxError) as error:
        group_cast(x, get_format(name), grouping, rule=rule, overflow=overflow)
    message = str(error.value)
    assert "\n" not in message and ("nan" in message or "inf" in message)


def test_zero_groups_and_empty_tensors():
    x = torch.zeros(2, 40)
    x[1, :3] = torch.tensor([1.0, -2.0, 0.5])
    amax_cast = group_cast(x, get_format("F143"), Grouping("tile", 32))
    assert amax_cast.log2_scales.flatten().tolist() == [0, 0, 6, 0]  # zero groups: scale 0
    mx_cast = group_cast(x, get_format("E4M3FN"), Grouping("tile", 32), rule="mx")
    assert mx_cast.log2_scales.flatten().tolist() == [127, 127, 7, 127]  # E8M0's 2**-127
    assert torch.equal(amax_cast.values, x) and torch.equal(mx_cast.values, x)
    empty = group_cast(torch.zeros(0, 5), get_format("F143"), Grouping("row"))
    assert empty.values.shape == (0, 5)


def test_negative_zero_and_subnormal_elements_follow_ml_dtypes():
    if not hasattr(ml_dtypes, "float4_e2m1fn"):
        pytest.skip("this ml_dtypes has no float4_e2m1fn")
    fmt = get_format("E2M1")
    x = torch.tensor([[-0.0, 0.25, 0.2500001, -0.75, 1.25, 6.0, 5.0, 1e-8] + [0.0] * 24])
    values = group_cast(x, fmt, Grouping("tile", 32), rule="mx").values
    # amax 6 = 1.5 * 2**2 and E2M1's emax is 2: the shared scale is 2**0.
    expected = x.numpy().astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(values.numpy().view(np.uint32), expected.view(np.uint32))


def test_grouped_casts_are_recorded_with_their_smallest_scale():
    x = torch.ones(2, 64)
    x[0] *= 100.0
    with fp8_stats() as stats:
        group_cast(x, get_format("F143"), Grouping("row"), site="probe")
    (record,) = stats.records
    assert record.site == "probe" and record.numel == 128
    assert record.log2_scale == log2_scale(100.0, "F143") == 1


@pytest.mark.parametrize("grouping", [Grouping("row"), Grouping("tile", 32),
                                      Grouping("block", 16)], ids=str)
def test_a_transposed_operand_casts_as_its_contiguous_copy_with_statistics_on(grouping):
    # The FP8 linear casts x.t() without copying it; recording statistics (telemetry's sampled
    # steps) takes the path without the fused kernel, which must take the view as well.
    x = wide_tensor(48, 40, seed=5)
    expected = group_cast(x.t().contiguous(), get_format("F143"), grouping)
    without = group_cast(x.t(), get_format("F143"), grouping)
    with fp8_stats() as stats:
        recorded = group_cast(x.t(), get_format("F143"), grouping, site="probe")
    assert len(stats.records) == 1
    for got in (without, recorded):
        assert torch.equal(got.log2_scales, expected.log2_scales)
        assert torch.equal(got.values.view(torch.int32), expected.values.view(torch.int32))

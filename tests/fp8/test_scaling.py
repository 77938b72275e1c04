"""The AMAX scaling-bias rule, scaled casts, the host-path hook, statistics and FP8Config."""
from __future__ import annotations

import math
import sys
import types

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ipu_unit_scaling.fp8 import (
    E4M3FN,
    E5M2,
    F143,
    F152,
    FP8Config,
    Fp8Tensor,
    NonFiniteAmaxError,
    cast_from_fp8,
    cast_to_fp8,
    cast_to_fp8_reference,
    fp8_stats,
    log2_scale,
)

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

FORMATS = [F143, F152, E4M3FN, E5M2]
ML_DTYPES = {"F143": ml_dtypes.float8_e4m3fnuz, "F152": ml_dtypes.float8_e5m2fnuz,
             "E4M3FN": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2}

positive_amax = st.floats(min_value=1e-40, max_value=1e38, allow_nan=False,
                          allow_infinity=False, exclude_min=False)


def exact_floor_log2_ratio(amax: float, fmt_max: float) -> int:
    """Largest k with amax * 2**k <= fmt_max, by exact float64 power-of-two comparisons."""
    k = math.floor(math.log2(fmt_max / amax))
    while math.ldexp(amax, k) > fmt_max:
        k -= 1
    while math.ldexp(amax, k + 1) <= fmt_max:
        k += 1
    return k


@settings(max_examples=300, deadline=None)
@given(amax=positive_amax, fmt=st.sampled_from(FORMATS), margin=st.integers(0, 31))
def test_scaled_amax_lands_in_the_top_binade(amax, fmt, margin):
    s = log2_scale(amax, fmt, margin)
    assert isinstance(s, int) and -31 <= s <= 31
    k = exact_floor_log2_ratio(amax, fmt.max)
    assert s == max(-31, min(31, k - margin))
    scaled = math.ldexp(amax, s + margin)  # exact: a power-of-two multiply in float64
    if -31 < s < 31:  # not clamped
        assert scaled <= fmt.max
        assert scaled > fmt.max / 2
    elif s == 31:
        assert scaled <= fmt.max
    else:  # clamped below: amax is too large to bring into range
        assert k - margin <= -31


@settings(max_examples=100, deadline=None)
@given(amax=st.floats(min_value=1e-30, max_value=1e30), fmt=st.sampled_from(FORMATS))
def test_tensor_amax_gives_the_same_scale(amax, fmt):
    as_float32 = float(np.float32(amax))
    if as_float32 == 0 or not math.isfinite(as_float32):
        return
    assert log2_scale(torch.tensor(as_float32), fmt) == log2_scale(as_float32, fmt)


def test_scale_at_exact_powers_of_two():
    assert log2_scale(240.0, F143) == 0
    assert log2_scale(np.nextafter(240.0, 1e9), F143) == -1
    assert log2_scale(120.0, F143) == 1
    assert log2_scale(np.nextafter(120.0, 0), F143) == 1
    assert log2_scale(57344.0, F152, margin=3) == -3


def test_zero_and_non_finite_amax():
    assert log2_scale(0.0, F143) == 0 and log2_scale(torch.tensor(0.0), F152, margin=3) == 0
    for bad in (math.inf, -math.inf, math.nan, torch.tensor(math.nan)):
        with pytest.raises(NonFiniteAmaxError):
            log2_scale(bad, F143)
    assert issubclass(NonFiniteAmaxError, ValueError)
    with pytest.raises(NonFiniteAmaxError):
        cast_to_fp8(torch.tensor([1.0, math.inf]), F143)
    with pytest.raises(ValueError, match=">= 0"):
        log2_scale(-1.0, F143)


@pytest.mark.parametrize("margin", [-1, 32, 1.5, True, "3"])
def test_margin_out_of_range(margin):
    with pytest.raises(ValueError, match="margin"):
        log2_scale(1.0, F143, margin=margin)
    with pytest.raises(ValueError, match="margin"):
        cast_to_fp8(torch.ones(3), F143, margin=margin)


def test_explicit_scale_checked():
    with pytest.raises(ValueError, match="log2_scale"):
        cast_to_fp8(torch.ones(3), F143, log2_scale=32)
    with pytest.raises(ValueError, match="log2_scale"):
        cast_to_fp8(torch.ones(3), F143, log2_scale=1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float"):
        cast_to_fp8(torch.ones(3, dtype=torch.int32), F143)


def oracle_cast(x: np.ndarray, fmt, s: int) -> np.ndarray:
    """ml_dtypes cast of the exact product x * 2**s (float64 holds it exactly)."""
    scaled = np.clip(x.astype(np.float64) * 2.0**s, -fmt.max, fmt.max)
    return scaled.astype(np.float32).astype(ML_DTYPES[fmt.name]).view(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("margin", [0, 3])
def test_amax_cast_matches_oracle(fmt, margin):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3e-3
    t = cast_to_fp8(x, fmt, margin=margin)
    assert isinstance(t, Fp8Tensor) and t.codes.dtype == torch.uint8 and t.codes.shape == x.shape
    amax = float(x.abs().max())
    expected_s = math.floor(math.log2(fmt.max / amax)) - margin  # float64 is fine off-boundary
    assert t.log2_scale == expected_s
    np.testing.assert_array_equal(t.codes.numpy(), oracle_cast(x.numpy(), fmt, expected_s))
    back = cast_from_fp8(t)
    rel = ((back - x).abs() / x.abs().clamp_min(amax * 2.0 ** -(margin + 6))).max().item()
    assert rel <= 2.0 ** -fmt.mantissa_bits


def test_float16_input_scaled_without_overflow_or_underflow():
    # 1e-7 is a float16 subnormal; 60000 is near float16's max. Scaled in float16 these would
    # lose bits or overflow; the rule scales in float32.
    x = torch.tensor([6e-8, 1e-7, 3e-6, -60000.0, 65504.0], dtype=torch.float16)
    for s in (20, -10):
        codes = cast_to_fp8(x, F152, log2_scale=s).codes.numpy()
        np.testing.assert_array_equal(codes, oracle_cast(x.float().numpy(), F152, s))


def test_static_cast_saturates_infinities_and_keeps_nan():
    x = torch.tensor([1e9, -math.inf, math.inf, math.nan, 1.0])
    t = cast_to_fp8(x, F143, log2_scale=0)
    assert cast_from_fp8(t)[:3].tolist() == [240.0, -240.0, 240.0]
    assert t.codes[3].item() == 0x80
    t = cast_to_fp8(x, E5M2, log2_scale=0, overflow="nan")
    assert cast_from_fp8(t)[:3].tolist() == [math.inf, -math.inf, math.inf]


def test_cast_from_fp8_dtype_and_type_check():
    t = cast_to_fp8(torch.randn(10), E4M3FN, log2_scale=5)
    assert cast_from_fp8(t, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(t.dequantise(), cast_from_fp8(t))
    with pytest.raises(TypeError):
        cast_from_fp8(t.codes)  # type: ignore[arg-type]


def test_stochastic_cast_uses_generator():
    x = torch.randn(1000)
    a = cast_to_fp8(x, F143, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    b = cast_to_fp8(x, F143, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, cast_to_fp8(x, F143).codes)


def install_fake_host(monkeypatch, available: bool):
    calls = []

    def fused_cast_to_fp8(x, fmt_name, scale, margin, saturate):
        calls.append((x.dtype, fmt_name, scale, margin, saturate))
        t = cast_to_fp8_reference(x, fmt_name, scale, margin,
                                  overflow="saturate" if saturate else "nan")
        return t.codes, t.log2_scale

    host = types.ModuleType("ipu_unit_scaling.fp8.host_library")
    host.fused_cast_available = lambda: available  # type: ignore[attr-defined]
    host.fused_cast_to_fp8 = fused_cast_to_fp8  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ipu_unit_scaling.fp8.host_library", host)
    import ipu_unit_scaling.fp8

    monkeypatch.setattr(ipu_unit_scaling.fp8, "host_library", host, raising=False)
    return calls


def test_host_path_used_only_where_it_applies(monkeypatch):
    calls = install_fake_host(monkeypatch, available=True)
    x = torch.randn(8, 16)
    t = cast_to_fp8(x, "e4m3fn", margin=2, overflow="nan")
    assert calls == [(torch.float32, "E4M3FN", None, 2, False)]
    assert torch.equal(t.codes, cast_to_fp8_reference(x, E4M3FN, margin=2, overflow="nan").codes)
    cast_to_fp8(x.half(), F143, log2_scale=3)
    assert calls[-1] == (torch.float16, "F143", 3, 0, True)
    n = len(calls)
    cast_to_fp8(x.double(), F143)  # float64: reference
    cast_to_fp8(x.t(), F143)  # not contiguous
    cast_to_fp8(x, F143, rounding="stochastic")
    assert len(calls) == n


def test_host_path_skipped_when_unavailable(monkeypatch):
    calls = install_fake_host(monkeypatch, available=False)
    cast_to_fp8(torch.randn(4), F143)
    assert calls == []


def test_stats_record_scale_flushes_and_saturation():
    x = torch.tensor([1.0, 1e-9, -2e-9, 0.0, 300.0, -1e4, 2.0, 0.5])
    with fp8_stats() as stats:
        cast_to_fp8(x, F143, log2_scale=0, site="a")
        cast_to_fp8(x, F143, site="b")
    a, b = stats.records
    assert (a.site, a.format, a.log2_scale, a.numel, a.nonzero) == ("a", "F143", 0, 8, 7)
    assert (a.flushed, a.saturated) == (2, 2)
    assert a.flushed_fraction == pytest.approx(2 / 7) and a.saturated_fraction == 0.25
    assert b.log2_scale == log2_scale(1e4, F143) and b.saturated == 0
    assert stats.by_site().keys() == {"a", "b"}
    # Off outside the block.
    cast_to_fp8(x, F143)
    assert len(stats.records) == 2


def test_config_validation():
    config = FP8Config()
    assert (config.activation, config.weight, config.gradient) == (F143, F143, F152)
    assert config.gradient_margin == 3 and config.scaling == "amax"
    with pytest.raises(ValueError, match="valid formats are"):
        FP8Config(gradient_format="E3M4")
    with pytest.raises(ValueError, match="gradient_margin"):
        FP8Config(gradient_margin=40)
    with pytest.raises(ValueError, match="scaling"):
        FP8Config(scaling="dynamic")
    with pytest.raises(ValueError, match="rounding"):
        FP8Config(rounding="down")
    with pytest.raises(ValueError, match="overflow"):
        FP8Config(overflow="clip")

"""FP8 formats and codec against independent oracles (ml_dtypes, gfloat)."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from ipu_unit_scaling import fp8
from ipu_unit_scaling.fp8 import E4M3FN, E5M2, F143, F152, decode, encode, get_format, quantise

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

ML_DTYPES = {
    "F143": ml_dtypes.float8_e4m3fnuz,
    "F152": ml_dtypes.float8_e5m2fnuz,
    "E4M3FN": ml_dtypes.float8_e4m3fn,
    "E5M2": ml_dtypes.float8_e5m2,
}
GFLOAT_P3109_PRECISION = {"F143": 4, "F152": 3}  # P3109 8-bit, signed, finite: the fnuz ones
GFLOAT_OCP_NAMES = {"E4M3FN": "format_info_ocp_e4m3", "E5M2": "format_info_ocp_e5m2"}
FORMATS = [F143, F152, E4M3FN, E5M2]
ALL_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def has_dtype(fmt: fp8.FP8Format) -> bool:
    return hasattr(torch, fmt.torch_dtype_name)


def needs_dtype(fmt: fp8.FP8Format) -> pytest.MarkDecorator:
    # torch 2.0.1 (the Poplar SDK's) has no float8 dtypes; the OCP ones came in 2.1, fnuz in 2.2.
    return pytest.mark.skipif(
        not has_dtype(fmt), reason=f"needs torch.{fmt.torch_dtype_name} (a torch float8 dtype)")


# Every format with each codec backend: "bits" everywhere, "dtype" where torch has the dtype.
FORMAT_BACKENDS = [pytest.param(fmt, "bits", id=f"bits-{fmt}") for fmt in FORMATS] + [
    pytest.param(fmt, "dtype", id=f"dtype-{fmt}", marks=needs_dtype(fmt)) for fmt in FORMATS
]


def ml_encode(x: np.ndarray, fmt: fp8.FP8Format) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float32).astype(ML_DTYPES[fmt.name]).view(np.uint8)


def ml_decode_all(fmt: fp8.FP8Format) -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(ML_DTYPES[fmt.name]).astype(np.float32)


def assert_same_floats(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal bit for bit, except that any NaN matches any NaN."""
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    np.testing.assert_array_equal(actual[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_format_facts_match_ml_dtypes(fmt):
    info = ml_dtypes.finfo(ML_DTYPES[fmt.name])
    values = ml_decode_all(fmt)
    assert fmt.max == float(info.max)
    assert fmt.min_normal == float(info.tiny)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.exponent_bits == info.nexp and fmt.mantissa_bits == info.nmant
    assert tuple(int(c) for c in np.flatnonzero(np.isnan(values))) == fmt.nan_codes
    assert fmt.has_inf == bool(np.isinf(values).any())
    negative_zero = (values == 0) & np.signbit(values)
    assert fmt.has_negative_zero == bool(negative_zero.any())
    assert fmt.torch_dtype_name in {"float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3fn",
                                    "float8_e5m2"}


def test_ipu_formats_are_the_fnuz_dtypes():
    assert (F143.max, F143.bias, F143.nan_codes, F143.has_inf) == (240.0, 8, (0x80,), False)
    assert (F152.max, F152.bias, F152.nan_codes, F152.has_inf) == (57344.0, 16, (0x80,), False)
    assert F143.torch_dtype_name == "float8_e4m3fnuz" and F152.torch_dtype_name == "float8_e5m2fnuz"
    assert E4M3FN.max == 448.0 and E5M2.has_inf


@pytest.mark.parametrize("fmt, backend", FORMAT_BACKENDS)
def test_decode_all_codes_matches_ml_dtypes(fmt, backend):
    assert_same_floats(decode(ALL_CODES, fmt, backend=backend).numpy(), ml_decode_all(fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_decode_all_codes_matches_gfloat(fmt):
    gfloat = pytest.importorskip("gfloat")
    from gfloat.formats import format_info_p3109
    from gfloat.types import Domain, Signedness

    if fmt.name in GFLOAT_OCP_NAMES:
        info = getattr(pytest.importorskip("gfloat.formats"), GFLOAT_OCP_NAMES[fmt.name])
    else:
        info = format_info_p3109(
            8, GFLOAT_P3109_PRECISION[fmt.name], Signedness.Signed, Domain.Finite)
    expected = np.array([gfloat.decode_float(info, c).fval for c in range(256)], np.float64)
    expected32 = expected.astype(np.float32)
    assert_same_floats(decode(ALL_CODES, fmt, backend="bits").numpy(), expected32)


def special_values(fmt: fp8.FP8Format) -> np.ndarray:
    """Every tie between neighbours, the values just either side, boundaries and specials."""
    values = np.array(fmt.values[:128], np.float64)
    finite = np.sort(values[np.isfinite(values)])
    ulp_at_max = fmt.overflow_threshold - fmt.max  # half an ulp
    finite_ext = np.append(finite, fmt.max + 2 * ulp_at_max)  # next value of an unbounded range
    ties = (finite_ext[:-1] + finite_ext[1:]) / 2  # exact in float32
    ties32 = ties.astype(np.float32)
    assert np.all(ties32.astype(np.float64) == ties)
    around = np.concatenate([
        ties32, np.nextafter(ties32, np.float32(np.inf)), np.nextafter(ties32, np.float32(0)),
        finite.astype(np.float32),
        np.array([fmt.min_subnormal / 2, fmt.min_subnormal / 4, fmt.min_normal,
                  fmt.min_normal - fmt.min_subnormal / 2, fmt.max, fmt.max * 1.0001,
                  fmt.max * 4, 1e30, 3.4e38, 1e-30, 1e-45], np.float32),
    ])
    signed = np.concatenate([around, -around])
    specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0], np.float32)
    payload_nans = np.array([0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF],
                            np.uint32).view(np.float32)
    return np.concatenate([signed, specials, payload_nans])


def random_values(n: int, seed: int) -> np.ndarray:
    """Values spanning float32's whole range: random sign, exponent and mantissa bits."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    wide = bits.view(np.float32)
    # Half of them concentrated on the FP8 ranges, where the interesting rounding happens.
    narrow = (rng.standard_normal(n) * np.exp2(rng.uniform(-22, 18, n))).astype(np.float32)
    return np.concatenate([wide[: n // 2], narrow[: n - n // 2]])


@pytest.fixture(scope="module")
def encode_cases():
    """Per format: inputs, and ml_dtypes' codes under the "nan" and "saturate" policies."""
    cases = {}
    for fmt in FORMATS:
        x = np.concatenate([random_values(1 << 20, 7), special_values(fmt)])
        # Saturation oracle: clip in float64 (NaN passes through), then ml_dtypes' own cast.
        with np.errstate(invalid="ignore"):  # signalling NaNs among the inputs
            saturated = np.clip(x.astype(np.float64), -fmt.max, fmt.max)
        cases[fmt.name] = (x, ml_encode(x, fmt), ml_encode(saturated, fmt))
    return cases


@pytest.mark.parametrize("fmt, backend", FORMAT_BACKENDS)
def test_encode_matches_ml_dtypes(fmt, backend, encode_cases):
    x, expected_nan_policy, expected_saturate = encode_cases[fmt.name]
    xt = torch.from_numpy(x)
    got = encode(xt, fmt, overflow="nan", backend=backend).numpy()
    bad = np.flatnonzero(got != expected_nan_policy)
    assert bad.size == 0, (x[bad[:5]], got[bad[:5]], expected_nan_policy[bad[:5]])
    got = encode(xt, fmt, overflow="saturate", backend=backend).numpy()
    np.testing.assert_array_equal(got, expected_saturate)


@pytest.mark.parametrize("fmt, backend", FORMAT_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_encode_other_input_dtypes(fmt, backend, dtype):
    x = torch.from_numpy(random_values(4096, 3)).to(dtype)
    widened = x.to(torch.float32).numpy()
    got = encode(x, fmt, overflow="nan", backend=backend).numpy()
    np.testing.assert_array_equal(got, ml_encode(widened, fmt))


def test_without_float8_dtypes_auto_is_the_bits_backend(monkeypatch):
    """What torch 2.0.1 (no float8 dtypes) sees, on any torch: 'auto' uses bit arithmetic."""
    x = random_values(1 << 14, 11)
    for fmt in FORMATS:
        monkeypatch.delattr(torch, fmt.torch_dtype_name, raising=False)
    for fmt in FORMATS:
        assert fmt.torch_dtype is None
        codes = encode(torch.from_numpy(x), fmt, overflow="nan")  # auto
        np.testing.assert_array_equal(codes.numpy(), ml_encode(x, fmt))
        assert_same_floats(decode(ALL_CODES, fmt).numpy(), ml_decode_all(fmt))
        with pytest.raises(RuntimeError, match="backend='bits'"):
            encode(torch.from_numpy(x), fmt, backend="dtype")
        with pytest.raises(RuntimeError, match="backend='bits'"):
            decode(ALL_CODES, fmt, backend="dtype")


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_quantise_is_decode_of_encode(fmt):
    x = torch.randn(1000, dtype=torch.float16) * 8
    q = quantise(x, fmt)
    assert q.dtype == torch.float16
    expected = ml_encode(x.float().numpy(), fmt).view(ML_DTYPES[fmt.name]).astype(np.float32)
    np.testing.assert_array_equal(q.float().numpy(), expected)


STOCHASTIC_VALUES = [1.3, -0.0371, 3.3e-4, 100.7, 1e-6]


@pytest.mark.parametrize("fmt, backend", FORMAT_BACKENDS)
@pytest.mark.parametrize("value", STOCHASTIC_VALUES)
def test_stochastic_rounding_is_unbiased(fmt, backend, value):
    n = 20000
    x = torch.full((n,), value, dtype=torch.float32)
    x32 = float(np.float32(value))
    grid = np.array(fmt.values[:128], np.float64)
    grid = np.sort(grid[np.isfinite(grid)])
    lo = grid[grid <= abs(x32)].max()
    hi = grid[grid >= abs(x32)].min()
    generator = torch.Generator().manual_seed(1234)
    codes = encode(x, fmt, rounding="stochastic", generator=generator, backend=backend)
    values = decode(codes, fmt, backend=backend).double().numpy()
    assert set(np.abs(values).tolist()) <= {lo, hi}
    if lo != hi:
        p = (abs(x32) - lo) / (hi - lo)
        sigma = (hi - lo) * math.sqrt(p * (1 - p) / n)
        assert abs(values.mean() - x32) <= 3 * sigma
        assert len(set(np.abs(values).tolist())) == 2


@pytest.mark.parametrize("fmt", [pytest.param(f, id=str(f), marks=needs_dtype(f)) for f in FORMATS])
def test_stochastic_rounding_same_codes_on_both_backends(fmt):
    x = torch.tensor(STOCHASTIC_VALUES, dtype=torch.float32).repeat(1000)
    codes = [
        encode(x, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(5),
               backend=backend)
        for backend in ("bits", "dtype")
    ]
    assert torch.equal(codes[0], codes[1])


def test_stochastic_rounding_overflow_follows_policy():
    x = torch.full((1000,), 239.0)  # between 224 and 240 = max: never overflows
    assert decode(encode(x, F143, rounding="stochastic"), F143).max().item() == 240.0
    x = torch.full((1000,), 250.0)  # between max and 256, the next step of the exponent range
    assert torch.all(decode(encode(x, F143, rounding="stochastic"), F143) == 240.0)
    codes = encode(x, F143, rounding="stochastic", overflow="nan")
    assert set(codes.tolist()) == {0x7F, 0x80}  # rounded down to max, or up and overflowed
    x = torch.full((1000,), 260.0)  # between 256 and 288: always overflows
    assert torch.all(encode(x, F143, rounding="stochastic", overflow="nan") == 0x80)


def test_get_format():
    assert get_format("f143") is F143 and get_format("E5m2") is E5M2 and get_format(F152) is F152
    with pytest.raises(ValueError, match="F143, F152, E4M3FN, E5M2"):
        get_format("E4M3")


def test_bad_input_errors():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        encode(torch.arange(4), F143)
    with pytest.raises(TypeError, match="uint8"):
        decode(torch.zeros(4, dtype=torch.int8), F143)
    with pytest.raises(ValueError, match="rounding"):
        encode(torch.zeros(4), F143, rounding="up")
    with pytest.raises(ValueError, match="overflow"):
        encode(torch.zeros(4), F143, overflow="wrap")
    with pytest.raises(ValueError, match="unknown FP8 format"):
        encode(torch.zeros(4), "F8")


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=needs_dtype(f), id=str(f)) for f in FORMATS])
def test_decode_float8_gives_the_conversions_bits_by_lookup(fmt):
    """The table lookup that replaces torch's float8-to-float32 conversion on a CPU gives its
    bits for every code (NaN payloads and signed zeros included), in any layout, into `out`."""
    from ipu_unit_scaling.fp8.codec import decode_float8

    codes = ALL_CODES.view(fmt.torch_dtype)
    expected = codes.to(torch.float32).view(torch.int32)
    assert torch.equal(decode_float8(codes, fmt).view(torch.int32), expected)
    grid = codes.view(16, 16)
    for values in (grid, grid.t()):
        want = values.to(torch.float32).view(torch.int32)
        assert torch.equal(decode_float8(values, fmt).view(torch.int32), want)
        for out in (torch.empty(16, 16), torch.empty(16, 16).t()):
            assert decode_float8(values, fmt, out=out) is out
            assert torch.equal(out.view(torch.int32) if out.is_contiguous()
                               else out.contiguous().view(torch.int32), want)

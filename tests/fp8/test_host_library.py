"""The host build of the FP8 codelets: the fused cast against ml_dtypes and the torch reference."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import ROOT

from ipu_unit_scaling.fp8 import (
    F143,
    F152,
    FP8Format,
    NonFiniteAmaxError,
    cast_to_fp8,
    cast_to_fp8_reference,
    log2_scale,
)
from ipu_unit_scaling.fp8 import host_library as _host

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("host_library")]

ML_DTYPES = {"F143": ml_dtypes.float8_e4m3fnuz, "F152": ml_dtypes.float8_e5m2fnuz}
FORMATS = [F143, F152]
POLICIES = ["saturate", "nan"]


def ml_cast(x: torch.Tensor, fmt: FP8Format, scale: int, overflow: str) -> torch.Tensor:
    """The independent oracle: float32 multiply by 2**scale, then ml_dtypes' fnuz cast.

    ml_dtypes' fnuz casts give NaN on overflow, which is the "nan" policy; "saturate" clamps
    finite and infinite values to +-max first (NaN stays NaN).
    """
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = x.to(torch.float32).numpy() * np.float32(2.0**scale)
        if overflow == "saturate":
            scaled = np.where(np.isnan(scaled), scaled, np.clip(scaled, -fmt.max, fmt.max))
        codes = scaled.astype(np.float32).astype(ML_DTYPES[fmt.name]).view(np.uint8)
    return torch.from_numpy(codes.copy())


def fused(x: torch.Tensor, fmt: FP8Format, scale=None, margin=0, overflow="saturate"):
    result = _host.fused_cast_to_fp8(x, fmt.name, scale, margin, overflow == "saturate")
    assert result is not None
    return result


def special_values(dtype: torch.dtype) -> torch.Tensor:
    finfo = torch.finfo(dtype)
    values = [0.0, -0.0, 240.0, -240.0, 57344.0, -57344.0, 247.9, 248.0, 256.0, -300.0,
              61439.0, 61440.0, 1e5, -1e5, 2.0**-7, 2.0**-10, 2.0**-11, 1.5 * 2.0**-11,
              2.0**-15, 2.0**-17, 2.0**-18, 3 * 2.0**-18, -(2.0**-18), finfo.tiny,
              finfo.tiny / 4, -finfo.tiny / 4, finfo.max, -finfo.max, 1.0, -1.0, 0.5,
              float("inf"), float("-inf"), float("nan")]
    return torch.tensor(values, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("overflow", POLICIES)
def test_every_float16_matches_ml_dtypes(fmt, overflow):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for scale in (-31, -9, 0, 4, 17, 31):
        codes, used = fused(x, fmt, scale=scale, overflow=overflow)
        assert used == scale
        assert torch.equal(codes, ml_cast(x, fmt, scale, overflow)), scale


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("overflow", POLICIES)
def test_random_float32_bit_patterns_match_ml_dtypes(fmt, overflow):
    generator = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31, (300_000,), dtype=torch.int64, generator=generator)
    x = bits.to(torch.int32).view(torch.float32)
    for scale in (-20, 0, 11):
        codes, _ = fused(x, fmt, scale=scale, overflow=overflow)
        assert torch.equal(codes, ml_cast(x, fmt, scale, overflow)), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("overflow", POLICIES)
def test_special_values_with_explicit_scale(dtype, fmt, overflow):
    x = special_values(dtype)
    for scale in (-3, 0, 3):
        codes, _ = fused(x, fmt, scale=scale, overflow=overflow)
        reference = cast_to_fp8_reference(x, fmt, log2_scale=scale, overflow=overflow)
        assert torch.equal(codes, reference.codes)
        assert torch.equal(codes, ml_cast(x, fmt, scale, overflow))


@pytest.mark.parametrize("size", [0, 1, 7, 1471, 1472 * 6 + 5, 140_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_amax_scaled_cast_matches_reference(size, dtype, fmt):
    generator = torch.Generator().manual_seed(size)
    x = (torch.randn(size, generator=generator) * 3.0**(size % 7 - 3)).to(dtype)
    for margin, overflow in ((0, "saturate"), (2, "nan")):
        codes, scale = fused(x, fmt, margin=margin, overflow=overflow)
        reference = cast_to_fp8_reference(x, fmt, margin=margin, overflow=overflow)
        assert scale == reference.log2_scale
        assert torch.equal(codes, reference.codes)


def test_cast_to_fp8_uses_the_fused_path_and_keeps_shape():
    x = torch.randn(3, 5, 7)
    result = cast_to_fp8(x, F143)
    reference = cast_to_fp8_reference(x, F143)
    assert result.codes.shape == (3, 5, 7) and result.codes.dtype == torch.uint8
    assert torch.equal(result.codes, reference.codes)
    assert result.log2_scale == reference.log2_scale


def test_ocp_formats_are_left_to_the_torch_path():
    assert _host.fused_cast_to_fp8(torch.ones(4), "E4M3FN", None, 0, True) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 77_777, 299_999])
def test_non_finite_amax_raises(bad, where):
    x = torch.randn(300_000)
    x[where] = bad
    with pytest.raises(_host.NonFiniteAmax) as raised:
        fused(x, F143)
    amax = raised.value.amax
    assert math.isnan(amax) if math.isnan(bad) else amax == math.inf
    with pytest.raises(NonFiniteAmaxError):  # fp8 turns the host's report into its error
        cast_to_fp8(x, F143)


def test_blocks_cast_before_the_amax_is_final_are_redone():
    # An amax growing along the tensor makes early blocks' provisional scales stale.
    x = torch.linspace(1e-3, 1e4, 300_000) * torch.where(torch.arange(300_000) % 2 == 0, 1, -1)
    for fmt in FORMATS:
        codes, scale = fused(x, fmt)
        reference = cast_to_fp8_reference(x, fmt)
        assert scale == reference.log2_scale
        assert torch.equal(codes, reference.codes)


def test_result_does_not_depend_on_thread_count():
    x = torch.randn(400_000) * 50
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fused(x, F152)
        torch.set_num_threads(max(2, threads))
        several = fused(x, F152)
    finally:
        torch.set_num_threads(threads)
    assert single[1] == several[1] and torch.equal(single[0], several[0])


def exact_floor_log2_ratio(numerator: float, denominator: float) -> int:
    ratio = Fraction(numerator) / Fraction(denominator)
    exponent = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    while Fraction(2) ** exponent > ratio:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= ratio:
        exponent += 1
    return exponent


def amax_sweep() -> list:
    values = []
    for e in range(-40, 41):
        p = np.float32(2.0**e)
        values += [p, np.nextafter(p, np.float32(0)), np.nextafter(p, np.float32(np.inf)),
                   p * np.float32(1.5), p * np.float32(240 / 256), p * np.float32(0.9375)]
    values += [np.float32(1e-45), np.float32(2.0**-130), np.float32(3.4e38)]
    return [float(v) for v in values]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_scaling_bias_vertex_matches_python_rule_across_the_sweep(fmt):
    from ipu_unit_scaling.fp8 import codelets_on_host as on_host

    for amax in amax_sweep():
        for margin in (0, 1, 3):
            expected = max(-31, min(31, exact_floor_log2_ratio(fmt.max, amax) - margin))
            assert log2_scale(amax, fmt, margin) == expected
            partials = torch.tensor([[amax / 2, -amax], [0.0, amax / 3]], dtype=torch.float32)
            assert on_host.scaling_bias_vertex(partials, fmt, margin) == (expected, False), amax


def test_scaling_bias_edge_cases():
    from ipu_unit_scaling.fp8 import codelets_on_host as on_host

    assert on_host.scaling_bias_vertex(torch.zeros(6), F143) == (0, False)
    assert on_host.scaling_bias_vertex(torch.tensor([1.0, float("nan")]), F143) == (0, True)
    assert on_host.scaling_bias_vertex(torch.tensor([float("inf"), 1.0]), F152) == (0, True)
    assert on_host.scaling_bias_vertex(torch.tensor([2.0**-100]), F143) == (31, False)
    assert on_host.scaling_bias_vertex(torch.tensor([3e38]), F152) == (-31, False)


def test_status_explains_a_missing_library(monkeypatch, tmp_path):
    monkeypatch.setattr(_host, "LIBRARY_PATH", tmp_path / "_fp8_host.so")
    monkeypatch.setattr(_host, "_library", None)
    monkeypatch.setattr(_host, "_reason", None)
    assert not _host.fused_cast_available()
    status = _host.fast_path_status()
    assert status.startswith("off:") and "was not built" in status
    with pytest.raises(_host.HostLibraryUnavailable, match="not built"):
        _host.library()
    x = torch.randn(1000)
    assert torch.equal(cast_to_fp8(x, F143).codes, cast_to_fp8_reference(x, F143).codes)


def test_disabled_library_falls_back_in_a_fresh_process():
    code = ("import torch; from ipu_unit_scaling.fp8 import cast_to_fp8, host_library as _host; "
            "print(_host.fast_path_status()); "
            "print(cast_to_fp8(torch.tensor([1.0, -300.0]), 'F143').codes.tolist())")
    env = dict(os.environ, **{_host.DISABLE_ENV: "0"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    status, codes = out.strip().splitlines()
    assert status.startswith("off: disabled by")
    # log2_scale = floor(log2(240 / 300)) = -1
    expected = ml_cast(torch.tensor([1.0, -300.0]), F143, -1, "saturate").tolist()
    assert codes == str(expected)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("scale", [-31, -5, 0, 3, 31])
def test_host_decode_equals_ml_dtypes_for_every_code(fmt: FP8Format, scale: int) -> None:
    from ipu_unit_scaling.fp8 import Fp8Tensor, cast_from_fp8

    codes = torch.arange(256, dtype=torch.uint8).repeat(5).reshape(40, 32)
    decoded = _host.fused_cast_from_fp8(codes, fmt.name, scale)
    assert decoded is not None
    oracle = codes.numpy().view(ML_DTYPES[fmt.name]).astype(np.float64) * 2.0**-scale
    expected = torch.from_numpy(oracle.astype(np.float32))
    assert torch.equal(decoded.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(decoded[finite].view(torch.int32), expected[finite].view(torch.int32))
    # cast_from_fp8 takes this path by default, transposed (non-contiguous) codes included.
    via_api = cast_from_fp8(Fp8Tensor(codes.t(), scale, fmt))
    assert torch.equal(via_api[finite.t()], expected.t()[finite.t()])

"""FP8 cast statistics (``fp8_stats``): each figure of a record against a direct computation
from the codes, over zeros, values below the smallest subnormal, overflow, infinities and NaN,
in every format and under both overflow policies."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

from ipu_unit_scaling.fp8 import FORMATS, cast_to_fp8, decode, fp8_stats
from ipu_unit_scaling.fp8.stats import _host_figures, record_cast

pytestmark = pytest.mark.numerics


def _input(fmt, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3000, generator=generator) * 2.0 ** torch.randint(-24, 12, (3000,),
                                                                      generator=generator)
    x[:50] = 0.0
    x[50:60] = -0.0
    x[60:70] = fmt.max * 4  # overflow
    if fmt.nan_codes:  # (the FP4 and FP6 formats have no NaN: non-finite input is refused)
        x[70:75] = math.inf
        x[75:78] = -math.inf
        x[78:80] = math.nan
    return x


@pytest.mark.parametrize("name, overflow", [
    (name, overflow) for name in sorted(FORMATS) for overflow in ("saturate", "nan")
    if overflow == "saturate" or FORMATS[name].nan_codes])  # (FP4 and FP6 have no NaN)
@pytest.mark.parametrize("figures", ["host library", "torch"])
def test_each_figure_of_a_record(name, overflow, figures):
    """The figures of the host library's one pass (8-bit formats, where it is built) and of
    the torch ops alike."""
    from ipu_unit_scaling.fp8 import host_library

    fmt = FORMATS[name]
    x = _input(fmt, len(name))
    if figures == "host library" and not (host_library.fused_cast_available()
                                           and fmt.sign_bit == 128):
        pytest.skip("the host library's figures take 8-bit codes and need the library")
    cast = cast_to_fp8(x, fmt, log2_scale=2, overflow=overflow)
    with fp8_stats() as stats, (host_library.disabled() if figures == "torch"
                                else contextlib.nullcontext()):
        host = _host_figures(x * 4, cast.codes, fmt) is not None
        record_cast("s.grad_output", x * 4, cast.codes, fmt, 2)
    assert host == (figures == "host library")
    (record,) = stats.records
    scaled = x.double() * 4
    finite = torch.isfinite(scaled)
    values = decode(cast.codes, fmt).double()
    zero_code = (cast.codes == 0) | ((cast.codes == fmt.sign_bit) if fmt.has_negative_zero
                                     else False)
    assert record.numel == 3000 and record.log2_scale == 2 and record.format == fmt.name
    assert record.nonzero == int(((scaled != 0) & finite).sum())
    assert record.flushed == int(((scaled != 0) & finite & zero_code).sum())
    assert record.saturated == int((scaled.abs() > fmt.max).sum())  # infinities included
    finite_x = x.double()[finite]
    assert record.amax == float(finite_x.abs().max())  # exact: one of the inputs
    # float32 dot products of n terms: relative error at most n * 2**-24
    bound = 3000 * 2.0 ** -24
    assert record.rms == pytest.approx(float(finite_x.square().mean().sqrt()), rel=bound)
    if overflow == "nan":  # a finite input turned NaN: infinitely bad
        assert record.sqnr_db == -math.inf
    else:
        signal = scaled[finite].square().sum()
        noise = (scaled[finite] - values[finite]).square().sum()
        # 10 log10(S/N) with S and N each within n * 2**-24: within 2 * 4.35 n 2**-24 dB
        assert record.sqnr_db == pytest.approx(float(10 * torch.log10(signal / noise)),
                                               abs=9 * bound)


def test_an_exact_cast_and_an_all_zero_cast():
    with fp8_stats() as stats:
        cast_to_fp8(torch.tensor([1.0, -2.0, 0.5]), "F143", log2_scale=0)
        cast_to_fp8(torch.zeros(4), "F143")
    exact, zeros = stats.records
    assert exact.sqnr_db == math.inf and exact.flushed == 0 and exact.amax == 2.0
    assert math.isnan(zeros.sqnr_db) and zeros.nonzero == 0 and zeros.flushed_fraction == 0.0


@pytest.mark.parametrize("overflow", ["saturate", "nan"])
@pytest.mark.parametrize("name", ["F143", "E4M3FN", "E5M2"])
def test_the_host_figures_at_each_simd_level(name, overflow):
    """The host library's figures with its AVX-512 loop and with its portable loop (forced):
    the counts and the amax alike, the float64 energies to their summation order's
    rounding (n terms: n 2**-53 relative)."""
    from ipu_unit_scaling.fp8 import host_library

    if not host_library.fused_cast_available():
        pytest.skip(host_library.fast_path_status())
    fmt = FORMATS[name]
    x = _input(fmt, 7)[:2995]  # (a tail past the last whole vector)
    codes = cast_to_fp8(x, fmt, log2_scale=2, overflow=overflow).codes
    widest = host_library.fused_tuning(-1, 2)
    try:
        figures = []
        for level in range(widest + 1):
            host_library.fused_tuning(-1, level)
            figures.append(_host_figures(x * 4, codes, fmt))
    finally:
        host_library.fused_tuning(-1, 2)
    for got in figures[1:]:
        assert got is not None and figures[0] is not None
        assert got[:4] == figures[0][:4] and got[6] == figures[0][6]
        assert got[4] == pytest.approx(figures[0][4], rel=3000 * 2.0 ** -53)
        if overflow == "saturate":
            assert got[5] == pytest.approx(figures[0][5], rel=3000 * 2.0 ** -53)
        else:  # finite values became NaN or inf: an error energy of NaN or inf alike
            assert not math.isfinite(got[5]) and str(got[5]) == str(figures[0][5])


@pytest.mark.parametrize("overflow", ["saturate", "nan"])
@pytest.mark.parametrize("name", ["F143", "F152", "E4M3FN", "E5M2"])
def test_the_figures_from_the_values_are_those_from_the_codes(name, overflow):
    """The host library's figures of a cast from its input and the FP8 values it gave (what a
    recorded FP8 linear casts with: no codes) against those from the scaled input and the
    codes, at each SIMD level: the counts and the amax alike, the float64 energies to their
    summation order's rounding (n terms: n 2**-53 relative)."""
    from ipu_unit_scaling.fp8 import host_library
    from ipu_unit_scaling.fp8.values import quantise_values

    if not host_library.fused_cast_available():
        pytest.skip(host_library.fast_path_status())
    fmt = FORMATS[name]
    x = _input(fmt, 11)[:2995]  # (a tail past the last whole vector)
    codes = cast_to_fp8(x, fmt, log2_scale=2, overflow=overflow).codes
    values, scale = quantise_values(x, fmt, 2, 0, overflow)
    assert scale == 2
    widest = host_library.fused_tuning(-1, 2)
    try:
        pairs = []
        for level in range(widest + 1):
            host_library.fused_tuning(-1, level)
            pairs.append((host_library.value_figures(x, values, 2, fmt.max),
                          _host_figures(x * 4, codes, fmt)))
    finally:
        host_library.fused_tuning(-1, 2)
    for got, want in pairs:
        assert got is not None and want is not None
        assert got[:4] == want[:4] and got[6] == want[6]
        assert got[4] == pytest.approx(want[4], rel=3000 * 2.0 ** -53)
        if overflow == "saturate":
            assert got[5] == pytest.approx(want[5], rel=3000 * 2.0 ** -53)
        else:  # finite values became NaN or inf: an error energy of NaN or inf alike
            assert not math.isfinite(got[5]) and str(got[5]) == str(want[5])


@pytest.mark.parametrize("scaling", ["static", "amax"])
def test_a_recorded_fp8_linear_records_what_the_codes_would_give(monkeypatch, scaling):
    """Under fp8_stats an FP8 linear rounds to values and records each cast from them; the
    records and the layer's values and gradients are those of the cast through codes (the
    path it takes where `cast_to_fp8` itself is replaced, as a test that watches the casts
    does)."""
    import ipu_unit_scaling as uu
    from ipu_unit_scaling.fp8 import FP8Config, linear
    from ipu_unit_scaling.fp8.linear import FP8UnitScaledLinear

    torch.manual_seed(0)
    layer = FP8UnitScaledLinear.from_unit_scaled(uu.Linear(64, 48, bias=True),
                                                 FP8Config(scaling=scaling))
    x = torch.randn(4, 16, 64) * 3
    x[0, 0, :8] = 0.0
    grad = torch.randn(4, 16, 48) * 1e-3

    def run():
        leaf = x.clone().requires_grad_()
        layer.zero_grad()
        with fp8_stats() as stats:
            out = layer(leaf)
            out.backward(grad)
        return stats.records, [out.detach(), leaf.grad, layer.weight.grad, layer.bias.grad]

    records, tensors = run()
    monkeypatch.setattr(linear, "cast_to_fp8", lambda *a, **k: cast_to_fp8(*a, **k))
    through_codes, codes_tensors = run()
    assert [r.site for r in records] == ["linear.input", "linear.weight", "linear.grad_output"]
    assert len(records) == len(through_codes)
    for got, want in zip(records, through_codes):
        assert (got.site, got.format, got.log2_scale, got.numel, got.nonzero, got.flushed,
                got.saturated, got.amax) == (want.site, want.format, want.log2_scale,
                                             want.numel, want.nonzero, want.flushed,
                                             want.saturated, want.amax)
        assert got.rms == pytest.approx(want.rms, rel=got.numel * 2.0 ** -52)
        assert got.sqnr_db == pytest.approx(want.sqnr_db, rel=got.numel * 2.0 ** -50)
    for got, want in zip(tensors, codes_tensors):
        assert torch.equal(got, want)

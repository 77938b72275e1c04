"""FP8 cast statistics (``fp8_stats``): each figure of a record against a direct computation
from the codes, over zeros, values below the smallest subnormal, overflow, infinities and NaN,
in every format and under both overflow policies."""
from __future__ import annotations

import math

import pytest
import torch

from ipu_unit_scaling.fp8 import FORMATS, cast_to_fp8, decode, fp8_stats

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
def test_each_figure_of_a_record(name, overflow):
    fmt = FORMATS[name]
    x = _input(fmt, len(name))
    with fp8_stats() as stats:
        cast = cast_to_fp8(x, fmt, log2_scale=2, overflow=overflow, site="s.grad_output")
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

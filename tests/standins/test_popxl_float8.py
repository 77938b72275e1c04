"""The PopXL stand-in's own float8 codec (it imports nothing of the package) against the
package's codec, bit for bit: element-wise rounding, so every code must agree."""
from __future__ import annotations

import pytest
import torch

from ipu_standins.popxl import _float8 as standin
from ipu_unit_scaling.fp8.codec import decode, encode

pytestmark = pytest.mark.numerics

FORMATS = [(standin.F143, "F143"), (standin.F152, "F152")]


@pytest.mark.parametrize("fmt, name", FORMATS, ids=["F143", "F152"])
def test_every_code_decodes_as_the_packages_codec(fmt, name):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, theirs = standin.decode(codes, fmt), decode(codes, name)
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours[~ours.isnan()], theirs[~theirs.isnan()])


@pytest.mark.parametrize("fmt, name", FORMATS, ids=["F143", "F152"])
def test_encoding_rounds_as_the_packages_codec_with_nan_on_overflow(fmt, name):
    values = torch.tensor(fmt.magnitudes, dtype=torch.float64)
    midpoints = (values[:-1] + values[1:]) / 2  # the ties, exact in float32 here
    top = values[-1] + (values[-1] - values[-2]) / 2  # rounds past the largest value
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(20000, generator=generator, dtype=torch.float64) * torch.exp2(
        torch.randint(-24, 20, (20000,), generator=generator).double())
    x = torch.cat([values, -values, midpoints, -midpoints, top.reshape(1),
                   torch.nextafter(top, torch.tensor(0.0, dtype=torch.float64)).reshape(1),
                   spread, torch.tensor([0.0, -0.0, float("inf"), -float("inf"),
                                         float("nan"), 1e-45])]).float()
    assert torch.equal(standin.encode(x, fmt), encode(x, name, overflow="nan"))
    half = x.half()
    assert torch.equal(standin.encode(half.float(), fmt), encode(half, name, overflow="nan"))

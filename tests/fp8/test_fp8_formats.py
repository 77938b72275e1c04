"""The MX element formats E2M1, E2M3 and E3M2 (FP4, FP6) against ml_dtypes, code for code."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from ipu_unit_scaling.fp8 import decode, encode, get_format
from ipu_unit_scaling.fp8.fp8_formats import SUB_BYTE_FORMATS

pytestmark = pytest.mark.numerics

ML_NAMES = {"E2M1": "float4_e2m1fn", "E2M3": "float6_e2m3fn", "E3M2": "float6_e3m2fn"}
FACTS = {  # (bits, max, largest exponent, smallest subnormal)
    "E2M1": (4, 6.0, 2, 0.5),
    "E2M3": (6, 7.5, 2, 0.125),
    "E3M2": (6, 28.0, 4, 0.0625),
}


def ml_dtype(name: str):
    dtype = getattr(ml_dtypes, ML_NAMES[name], None)
    if dtype is None:
        pytest.skip(f"this ml_dtypes has no {ML_NAMES[name]}")
    return dtype


@pytest.mark.parametrize("name", SUB_BYTE_FORMATS)
def test_format_facts(name):
    fmt = get_format(name)
    assert (fmt.bits, fmt.max, fmt.max_exponent, fmt.min_subnormal) == FACTS[name]
    assert len(fmt.values) == 2**fmt.bits and not fmt.nan_codes and fmt.torch_dtype is None


@pytest.mark.parametrize("name", SUB_BYTE_FORMATS)
def test_every_code_decodes_as_ml_dtypes(name):
    dtype = ml_dtype(name)
    fmt = get_format(name)
    codes = np.arange(2**fmt.bits, dtype=np.uint8)
    expected = codes.view(dtype).astype(np.float32)
    ours = decode(torch.from_numpy(codes), fmt).numpy()
    np.testing.assert_array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", SUB_BYTE_FORMATS)
def test_encode_rounds_and_saturates_as_ml_dtypes(name):
    dtype = ml_dtype(name)
    generator = torch.Generator().manual_seed(len(name))
    x = torch.randn(20000, generator=generator)
    x = x * torch.exp2(torch.randint(-12, 8, (20000,), generator=generator).float())
    fmt = get_format(name)
    # every midpoint between neighbours (ties to even), infinities, zeros, float32 subnormals
    grid = np.array(sorted(set(v for v in fmt.values if v >= 0)))
    midpoints = torch.from_numpy((grid[:-1] + grid[1:]) / 2).float()
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 1e30])
    x = torch.cat([x, midpoints, -midpoints, specials])
    ours = encode(x, fmt).numpy()
    np.testing.assert_array_equal(ours, x.numpy().astype(dtype).view(np.uint8))


@pytest.mark.parametrize("name", SUB_BYTE_FORMATS)
def test_nan_and_the_nan_overflow_policy_are_refused(name):
    with pytest.raises(ValueError, match="no NaN code"):
        encode(torch.tensor([1.0, float("nan")]), name)
    with pytest.raises(ValueError, match="only be 'saturate'"):
        encode(torch.tensor([1.0]), name, overflow="nan")

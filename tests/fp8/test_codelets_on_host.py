"""The codelets run on the host: vertices run tile by tile reproduce the torch reference exactly."""
from __future__ import annotations

from typing import Dict, Tuple

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import wide_range_input

from ipu_unit_scaling.fp8 import (
    F143,
    F152,
    Fp8Tensor,
    NonFiniteAmaxError,
    cast_from_fp8,
    cast_to_fp8_reference,
)
from ipu_unit_scaling.fp8 import codelets_on_host as on_host
from ipu_unit_scaling.fp8 import host_library as _host

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = [pytest.mark.numerics, pytest.mark.usefixtures("host_library")]

FORMATS = [F143, F152]
POLICIES = ["saturate", "nan"]
SIZES = [1, 7, 1471, 1472 * 6 + 5, 1 << 20]
TILES = [1, 4, 1472]
ML_DTYPES = {"F143": ml_dtypes.float8_e4m3fnuz, "F152": ml_dtypes.float8_e5m2fnuz}


_references: Dict[Tuple[int, torch.dtype, str, str], Tuple[torch.Tensor, int]] = {}


def reference(size: int, dtype: torch.dtype, fmt, overflow: str) -> Tuple[torch.Tensor, int]:
    key = (size, dtype, fmt.name, overflow)
    if key not in _references:
        result = cast_to_fp8_reference(wide_range_input(size, dtype), fmt, overflow=overflow)
        _references[key] = (result.codes, result.log2_scale)
    return _references[key]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("size", SIZES)
def test_emulator_matches_torch_reference(size, tiles, dtype):
    x = wide_range_input(size, dtype)
    for fmt in FORMATS:
        for overflow in POLICIES:
            workers = 6 if overflow == "saturate" else (5 if tiles < 1472 else 1)
            result = on_host.cast_to_fp8_vertices(x, fmt, overflow=overflow, tiles=tiles,
                                                   workers=workers)
            codes, scale = reference(size, dtype, fmt, overflow)
            assert result.log2_scale == scale
            assert torch.equal(result.codes, codes), (fmt.name, overflow, workers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("tiles,workers", [(1, 1), (4, 6), (1472, 6), (1472, 4)])
def test_partial_amaxes_reduce_to_the_exact_amax(dtype, tiles, workers):
    x = wide_range_input(100_003, dtype)
    partials = on_host.partial_amaxes(x, tiles, workers)
    assert partials.shape == (tiles, workers)
    assert partials.max().item() == x.abs().max().float().item()
    bounds = _host.partition(x.numel(), tiles, workers).reshape(-1, 2).tolist()
    for (begin, end), partial in zip(bounds, partials.reshape(-1).tolist()):
        expected = x[begin:end].abs().max().float().item() if end > begin else 0.0
        assert partial == expected


def test_nan_wins_in_the_partial_amax():
    x = torch.randn(10_000)
    x[1234] = float("nan")
    x[5000] = float("inf")
    partials = on_host.partial_amaxes(x, 4, 6)
    assert partials.isnan().sum() == 1 and partials.isinf().sum() == 1
    with pytest.raises(NonFiniteAmaxError):
        on_host.cast_to_fp8_vertices(x, F143, tiles=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("overflow", POLICIES)
def test_special_values(dtype, fmt, overflow):
    finfo = torch.finfo(dtype)
    values = [0.0, -0.0, fmt.max, -fmt.max, fmt.max * 1.04, -fmt.max * 1.1, fmt.max * 4,
              fmt.min_subnormal, -fmt.min_subnormal, fmt.min_subnormal / 2,
              fmt.min_subnormal * 0.75, fmt.min_normal * 0.6, finfo.tiny / 8, finfo.max,
              float("inf"), float("-inf"), float("nan")]
    x = torch.tensor(values * 3, dtype=torch.float32).to(dtype)
    for scale in (0, 2, -2):
        result = on_host.cast_to_fp8_vertices(x, fmt, log2_scale=scale, overflow=overflow, tiles=4)
        expected = cast_to_fp8_reference(x, fmt, log2_scale=scale, overflow=overflow)
        assert result.partials is None and result.log2_scale == scale
        assert torch.equal(result.codes, expected.codes), scale


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_zeros_and_extremes_with_amax_scaling(fmt):
    zeros = torch.zeros(1000)
    result = on_host.cast_to_fp8_vertices(zeros, fmt, tiles=8)
    assert result.log2_scale == 0 and int(result.codes.sum()) == 0
    extremes = torch.tensor([fmt.max, -fmt.max, 1.0, -(2.0**-20)] * 50)
    result = on_host.cast_to_fp8_vertices(extremes, fmt, margin=1, tiles=8)
    expected = cast_to_fp8_reference(extremes, fmt, margin=1)
    assert result.log2_scale == expected.log2_scale == -1
    assert torch.equal(result.codes, expected.codes)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_cast_from_fp8_decodes_every_code(fmt, dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(5)
    for scale in (0, 3, -4):
        decoded = on_host.cast_from_fp8_vertices(codes, fmt, scale, dtype=dtype, tiles=3)
        oracle = codes.numpy().view(ML_DTYPES[fmt.name]).astype(np.float32) * 2.0**-scale
        expected = torch.from_numpy(oracle.astype(np.float32)).to(dtype)
        assert torch.equal(decoded.isnan(), expected.isnan())
        finite = ~expected.isnan()
        assert torch.equal(decoded[finite], expected[finite])
        from ipu_unit_scaling.fp8 import Fp8Tensor

        via_torch = cast_from_fp8(Fp8Tensor(codes, scale, fmt), dtype)
        assert torch.equal(decoded[finite], via_torch[finite])


@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 100, 1471, 1472 * 8, 1472 * 6 + 5, 123_457])
@pytest.mark.parametrize("tiles,workers", [(1, 1), (1, 6), (4, 6), (7, 3), (1472, 6)])
def test_cpp_partition_is_the_python_one(numel, tiles, workers):
    assert torch.equal(_host.partition(numel, tiles, workers),
                       on_host.python_partition(numel, tiles, workers, _host.partition_grain()))


@pytest.mark.parametrize("numel", [1, 9, 1472 * 6 + 5, 123_457, 1 << 20])
@pytest.mark.parametrize("tiles,workers", [(4, 6), (1472, 6), (5, 4)])
def test_partition_covers_everything_once_in_aligned_balanced_slices(numel, tiles, workers):
    grain = _host.partition_grain()
    bounds = _host.partition(numel, tiles, workers)
    flat = bounds.reshape(-1, 2)
    assert flat[0, 0] == 0 and flat[-1, 1] == numel
    assert torch.equal(flat[1:, 0], flat[:-1, 1])  # contiguous, in order, no overlap
    non_empty = flat[:, 1] > flat[:, 0]
    assert bool((flat[non_empty, 0] % grain == 0).all())
    tile_sizes = bounds[:, -1, 1] - bounds[:, 0, 0]
    tile_grains = -(-tile_sizes // grain)  # whole grains differ by at most one between tiles
    assert int(tile_grains.max() - tile_grains.min()) <= 1
    worker_grains = -(-(bounds[..., 1] - bounds[..., 0]) // grain)
    assert int((worker_grains.max(dim=1).values - worker_grains.min(dim=1).values).max()) <= 1
    grains = -(-numel // grain)
    assert int((tile_sizes == 0).sum()) == max(0, tiles - grains)  # empty tiles past the data


def test_uneven_slices_and_empty_tiles_appear_on_a_full_ipu():
    bounds = _host.partition(1472 * 6 + 5, on_host.IPU_TILES, on_host.IPU_WORKERS)
    tile_sizes = (bounds[:, -1, 1] - bounds[:, 0, 0]).tolist()
    assert set(tile_sizes) == {0, 5, 8}
    assert tile_sizes.count(0) == 1472 - 1105


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_half_decode_rounds_to_nearest_even_at_every_scale(fmt):
    # Scales far from 0 push decoded values below half's subnormals and above its max, where
    # the vertex's integer conversion to half must round as numpy's float32 -> float16 does.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for scale in range(-31, 32):
        decoded = on_host.cast_from_fp8_vertices(codes, fmt, scale, dtype=torch.float16, tiles=2)
        with np.errstate(over="ignore"):
            oracle = (codes.numpy().view(ML_DTYPES[fmt.name]).astype(np.float32)
                      * np.float32(2.0**-scale)).astype(np.float16)
        expected = torch.from_numpy(oracle)
        assert torch.equal(decoded.isnan(), expected.isnan())
        finite = ~expected.isnan()
        same_bits = torch.equal(decoded[finite].view(torch.int16),
                                expected[finite].view(torch.int16))
        assert same_bits, scale


def test_half_decode_hits_ties_overflow_and_subnormals():
    # 1.5 * 2**-25 is 0.75 of half's smallest step; 2**-25 is a tie (to 0, even);
    # 1.5 * 2**-24 a tie (to 2 steps, even); 57344 * 2**31 overflows to inf.
    codes = torch.tensor([0x08, 0x0A, 0x0E, 0x7F, 0xFF], dtype=torch.uint8)  # F152 codes
    values = cast_from_fp8(Fp8Tensor(codes, 0, F152), torch.float32)
    assert values.tolist() == [2.0**-14, 1.5 * 2.0**-14, 1.5 * 2.0**-13, 57344.0, -57344.0]
    out = on_host.cast_from_fp8_vertices(codes, F152, 11, dtype=torch.float16, tiles=1)
    assert out[:3].tolist() == [0.0, 2.0**-24, 2.0**-23]
    out = on_host.cast_from_fp8_vertices(codes, F152, -31, dtype=torch.float16, tiles=1)
    assert out[3:].tolist() == [float("inf"), float("-inf")]


@pytest.mark.parametrize("offset", [1, 2, 4, 7])
def test_vertices_refuse_outputs_that_break_their_alignment(offset):
    # Sub-word outputs are declared 8-byte aligned, as Poplar lays them out; the host shim
    # checks the declaration, so a misaligned connection fails instead of running.
    lib = _host.library()
    x = torch.randn(64)
    codes = torch.zeros(64 + 8, dtype=torch.uint8)
    address = codes.data_ptr()
    assert address % 8 == 0
    status = lib.ius_vertex_cast_to_fp8(x.data_ptr(), 32, 0, 4, 1, 6, 0, address + offset)
    assert status == _host.MISALIGNED
    assert int(codes.sum()) == 0  # nothing was written
    assert lib.ius_vertex_cast_to_fp8(x.data_ptr(), 32, 0, 4, 1, 6, 0, address + 8) == 0
    halves = torch.zeros(64 + 8, dtype=torch.float16)
    status = lib.ius_vertex_cast_from_fp8(codes.data_ptr(), 32, 1, 4, 6, 0,
                                          halves.data_ptr() + 2 * offset)
    assert status == (_host.MISALIGNED if (2 * offset) % 8 else 0)
    # Inputs carry no such requirement: codes may start anywhere.
    floats = torch.zeros(64, dtype=torch.float32)
    assert lib.ius_vertex_cast_from_fp8(address + offset, 32, 0, 4, 6, 0, floats.data_ptr()) == 0

"""FP8 rounding straight to values: every path gives the bits of the codes round trip.

The reference is ``cast_from_fp8(cast_to_fp8(x))`` (itself tested against ml_dtypes); the paths
are the host library's fused kernel (AVX2 and portable loops, any block size, any thread
count), torch's float8 round trip, and the codec fallback.
"""
from __future__ import annotations

import math

import pytest
import torch
from helpers import require_host_library

from ipu_unit_scaling.fp8 import (
    F143,
    F152,
    FP8Config,
    FP8Linear,
    NonFiniteAmaxError,
    cast_from_fp8,
    cast_to_fp8_reference,
    fp8_stats,
    get_format,
    values,
)
from ipu_unit_scaling.fp8 import host_library as _host
from ipu_unit_scaling.fp8.linear import fp8_linear

# CI runs these a second time with torch's scalar CPU kernels (.ci/run).
pytestmark = pytest.mark.numerics

FORMATS = ["F143", "F152", "E4M3FN", "E5M2"]


def reference(x: torch.Tensor, fmt: str, log2_scale, margin=0, overflow="saturate"):
    cast = cast_to_fp8_reference(x, fmt, log2_scale, margin, overflow, backend="bits")
    return cast_from_fp8(cast, torch.float32), cast.log2_scale


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                              b.contiguous().view(torch.int32))


def edge_values() -> torch.Tensor:
    specials = [0.0, -0.0, 1.0, -1.0, 240.0, 248.0, 250.0, 57344.0, 61440.0, 1e30, -1e30,
                2.0**-7, 2.0**-10, 2.0**-11, 1.5 * 2.0**-11, 2.0**-15, 2.0**-17, 2.0**-18,
                3 * 2.0**-18, 1e-40, -1e-40, 2.0**-126, math.inf, -math.inf]
    return torch.tensor(specials, dtype=torch.float32)


def random_bits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(
        torch.int32).view(torch.float32)


@pytest.fixture(params=["host", "torch float8", "reference"])
def path(request, monkeypatch):
    if request.param == "host":
        require_host_library()
    else:
        monkeypatch.setattr(values, "_host_library", lambda: None)
    return request.param


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("log2_scale", [0, 5, -9, None])
def test_every_path_gives_the_round_trip_bits(path, fmt, log2_scale):
    if path == "torch float8" and get_format(fmt).torch_dtype is None:
        pytest.skip("this torch has no float8 dtype for the format")
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(5000, generator=g) * 30, edge_values()[:-2],
                   torch.randn(100, generator=g) * 2.0**-12])
    got, scale = values.quantise_values(x, get_format(fmt), log2_scale, margin=2)
    want, want_scale = reference(x, fmt, log2_scale, margin=2)
    assert scale == want_scale
    assert same_bits(got, want)


@pytest.mark.parametrize("fmt", ["F143", "F152"])
@pytest.mark.parametrize("overflow", ["saturate", "nan"])
def test_random_bit_patterns_nan_and_inf(path, fmt, overflow):
    x = torch.cat([random_bits(20000, 7), edge_values()])
    got, _ = values.quantise_values(x, get_format(fmt), 3, overflow=overflow)
    want, _ = reference(x, fmt, 3, overflow=overflow)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert same_bits(got[~nan], want[~nan])


def test_non_finite_amax_raises_on_every_path(path):
    for bad in (math.inf, math.nan):
        with pytest.raises(NonFiniteAmaxError):
            values.quantise_values(torch.tensor([1.0, bad]), F143)


def test_inputs_of_other_dtypes_and_layouts(path):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(33, 17, generator=g)
    for tensor in (x.t(), x.half(), x[:, ::2], torch.empty(0), x.double()):
        got, scale = values.quantise_values(tensor, F152)
        want, want_scale = reference(tensor.float(), "F152", None)
        assert scale == want_scale and same_bits(got, want)


def test_host_kernels_agree_across_simd_block_sizes_and_threads():
    require_host_library()
    g = torch.Generator().manual_seed(5)
    # The amax grows along the tensor, so early blocks are rounded with a stale scale and
    # must be redone: the driver's hardest case.
    x = torch.randn(1 << 19, generator=g) * torch.linspace(1e-3, 1e3, 1 << 19)
    want, want_scale = reference(x, "F143", None, margin=1)
    threads = torch.get_num_threads()
    try:
        for simd in (0, 1, 2):  # portable loops, AVX2, AVX-512 (each where the CPU has it)
            for block in (1024, 5000, 1 << 15, 1 << 20):
                for n_threads in (1, 3):
                    torch.set_num_threads(n_threads)
                    _host.fused_tuning(block, simd)
                    got, scale = values.quantise_values(x, F143, None, margin=1)
                    assert scale == want_scale and same_bits(got, want), (simd, block)
                    codes, scale = _host.fused_cast_to_fp8(x, "F143", None, 1, True)
                    assert torch.equal(codes, cast_to_fp8_reference(x, "F143", None, 1).codes)
    finally:
        torch.set_num_threads(threads)
        _host.fused_tuning(1 << 15, 2)


@pytest.mark.parametrize("log2_scale", [0, -31, 31, 4])
def test_fast_rounding_equals_the_vertex_code_on_strided_bit_patterns(log2_scale):
    """The full sweep over all 2**32 patterns is scripts/fp8_fast_path_sweep.py."""
    require_host_library()
    assert _host.fast_selftest(12345, 257, 1 << 22, log2_scale) == 0
    # Dense around the interesting exponents: F152's subnormals up to F143's overflow.
    assert _host.fast_selftest(0x37000000, 1, 1 << 20, log2_scale) == 0
    assert _host.fast_selftest(0x43700000, 1, 1 << 20, log2_scale) == 0


@pytest.mark.parametrize("scaling", ["static", "amax"])
def test_values_linear_equals_the_codes_linear(path, scaling):
    """The same FP8 linear through the values path and through codes (recorded casts take
    the codes path): the same products, float32 rounding apart."""
    g = torch.Generator().manual_seed(6)
    config = FP8Config(scaling=scaling)
    layer = FP8Linear(24, 40, config=config)
    x0 = torch.randn(3, 7, 24, generator=g)
    grad = torch.randn(3, 7, 40, generator=g)
    results = []
    for record in (False, True):
        x = x0.clone().requires_grad_()
        layer.zero_grad()
        if record:
            with fp8_stats():
                y = layer(x)
                y.backward(grad)
        else:
            y = layer(x)
            y.backward(grad)
        results.append([y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()])
    for fast, codes in zip(*results):
        torch.testing.assert_close(fast, codes, rtol=1e-6, atol=1e-6)


def test_values_path_keeps_values_not_inputs_for_backward(monkeypatch):
    from ipu_unit_scaling.ops import native_layers

    # (the Python Function, whose saved tensors Python sees; its C++ node keeps what it keeps:
    # tests/fp8/test_native_linear.py)
    monkeypatch.setattr(native_layers, "module", lambda: None)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    y = fp8_linear(x, w, None, FP8Config(scaling="static"))
    saved = y.grad_fn.saved_tensors
    assert all(t.dtype == torch.float32 for t in saved)
    assert not any(t.data_ptr() in (x.data_ptr(), w.data_ptr()) for t in saved)
    xq, _ = values.quantise_values(x.detach(), F143, 0)
    assert any(torch.equal(t, xq) for t in saved)


def test_path_names():
    assert values.values_path(F152, "nan") in ("host", "reference")
    if not _host.fused_cast_available():
        assert values.values_path(F143) in ("torch float8", "reference")

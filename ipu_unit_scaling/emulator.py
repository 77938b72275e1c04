"""Run the FP8 codelets on the host, tile by tile, as the Poplar graph runs them.

The PopART custom op (``custom_ops/``) builds this graph for a flat input of ``n`` elements::

    for every tile t:  PartialAmax<T>      on x[tile t]  -> partials[t, 0..workers)
    on one tile:       ScalingBias<E>      on partials    -> log2 scale, non-finite flag
    for every tile t:  CastToFp8<T, E, S>  on x[tile t]  -> codes[tile t]

and the ``Fp8Quantise`` op (and the grad op of ``Fp8GradientQuantise``) adds
``CastFromFp8<T, E>`` on every tile, back to x's dtype: see :func:`quantise`.
The emulator does the same with the same vertex sources, compiled for the host
(``_fp8_host.so``), and the same split: tile ranges come from the C++ partition function the
custom op uses, and each MultiVertex picks its workers' slices itself, exactly as on the IPU.
It needs the host library (see :func:`ipu_unit_scaling._host.fast_path_status`).
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional, Tuple

import torch

from . import _host
from .fp8 import MAX_LOG2_SCALE, FP8Format, NonFiniteAmaxError, get_format

__all__ = [
    "IPU_TILES", "IPU_WORKERS", "EmulatedCast", "partition", "python_partition",
    "partial_amaxes", "scaling_bias", "cast_to_fp8", "cast_from_fp8", "quantise",
]

# A Mk2 IPU (GC200): 1472 tiles, 6 hardware worker threads per tile.
IPU_TILES = 1472
IPU_WORKERS = 6
_OVERFLOW_POLICIES = ("saturate", "nan")


class EmulatedCast(NamedTuple):
    """What the custom op's graph produces, plus the intermediate the tests look at."""

    codes: torch.Tensor  # uint8, shaped like the input
    log2_scale: int
    partials: Optional[torch.Tensor]  # float32 [tiles, workers]; None when the scale was given


def partition(numel: int, tiles: int = IPU_TILES, workers: int = IPU_WORKERS) -> torch.Tensor:
    """int64 ``[tiles, workers, 2]``: the absolute [begin, end) each worker of each tile gets.

    Computed by the C++ function (``codelets/partition.hpp``) shared with the custom op.
    """
    return _host.partition(numel, tiles, workers)


def _split(length: int, parts: int, part: int, grain: int) -> Tuple[int, int]:
    grains = -(-length // grain)
    base, extra = divmod(grains, parts)
    first = part * base + min(part, extra)
    last = first + base + (1 if part < extra else 0)
    return min(first * grain, length), min(last * grain, length)


def python_partition(numel: int, tiles: int = IPU_TILES, workers: int = IPU_WORKERS,
                     grain: int = 8) -> torch.Tensor:
    """A Python copy of the C++ partition, for reading and for checking the two agree."""
    bounds = torch.empty((tiles, workers, 2), dtype=torch.int64)
    for t in range(tiles):
        tile_begin, tile_end = _split(numel, tiles, t, grain)
        for w in range(workers):
            begin, end = _split(tile_end - tile_begin, workers, w, grain)
            bounds[t, w, 0] = tile_begin + begin
            bounds[t, w, 1] = tile_begin + end
    return bounds


def _tile_ranges(numel: int, tiles: int, workers: int) -> torch.Tensor:
    """[tiles, 2] [begin, end) of each tile's slice of the flat tensor."""
    bounds = partition(numel, tiles, workers)
    return torch.stack([bounds[:, 0, 0], bounds[:, -1, 1]], dim=1)


def _flat_input(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"the emulator runs on CPU tensors, got {x.device}")
    _host.dtype_code(x.dtype)
    return x.detach().contiguous().reshape(-1)


def _address(t: torch.Tensor, element: int = 0) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() + element * t.element_size())


def _check(status: int, what: str) -> None:
    if status == _host.MISALIGNED:
        raise ValueError(f"{what}: a vertex field was connected to misaligned memory")
    if status != 0:
        raise ValueError(f"{what}: the host vertex rejected its arguments")


def partial_amaxes(x: torch.Tensor, tiles: int = IPU_TILES,
                   workers: int = IPU_WORKERS) -> torch.Tensor:
    """Run PartialAmax on every tile: float32 ``[tiles, workers]`` (0 for empty slices)."""
    lib = _host.library()
    flat = _flat_input(x)
    dtype = _host.dtype_code(flat.dtype)
    partials = torch.zeros((tiles, workers), dtype=torch.float32)
    for t, (begin, end) in enumerate(_tile_ranges(flat.numel(), tiles, workers).tolist()):
        if end == begin:
            continue  # no vertex on a tile that holds no input
        status = lib.ius_vertex_partial_amax(_address(flat, begin), end - begin, dtype, workers,
                                             _address(partials, t * workers))
        _check(status, "PartialAmax")
    return partials


def scaling_bias(partials: torch.Tensor, fmt: FP8Format, margin: int = 0) -> Tuple[int, bool]:
    """Run ScalingBias on the partials: (log2 scale, amax non-finite)."""
    lib = _host.library()
    flat = partials.detach().to(torch.float32).contiguous().reshape(-1)
    scale = ctypes.c_int(0)
    non_finite = ctypes.c_int(0)
    status = lib.ius_vertex_scaling_bias(_address(flat), flat.numel(),
                                         _host.exponent_bits(fmt.name), int(margin),
                                         ctypes.byref(scale), ctypes.byref(non_finite))
    _check(status, "ScalingBias")
    return scale.value, bool(non_finite.value)


def cast_to_fp8(
    x: torch.Tensor,
    fmt: object,
    log2_scale: Optional[int] = None,
    margin: int = 0,
    overflow: str = "saturate",
    tiles: int = IPU_TILES,
    workers: int = IPU_WORKERS,
) -> EmulatedCast:
    """Amax, scaling bias and cast to F143/F152, vertex by vertex and tile by tile.

    Same contract as :func:`ipu_unit_scaling.fp8.cast_to_fp8` with rounding to nearest:
    ``log2_scale=None`` derives the scale from the amax (an inf/NaN amax raises
    ``NonFiniteAmaxError``, as the host reads the vertex's non-finite flag).
    """
    fmt = get_format(fmt)  # type: ignore[arg-type]
    if overflow not in _OVERFLOW_POLICIES:
        raise ValueError(f"overflow policy must be one of {_OVERFLOW_POLICIES}, got {overflow!r}")
    lib = _host.library()
    exponent_bits = _host.exponent_bits(fmt.name)
    flat = _flat_input(x)
    dtype = _host.dtype_code(flat.dtype)

    partials: Optional[torch.Tensor] = None
    if log2_scale is not None and not -MAX_LOG2_SCALE <= log2_scale <= MAX_LOG2_SCALE:
        raise ValueError(f"log2_scale must be in -{MAX_LOG2_SCALE}..{MAX_LOG2_SCALE}")
    if log2_scale is None:
        partials = partial_amaxes(flat, tiles, workers)
        log2_scale, non_finite = scaling_bias(partials, fmt, margin)
        if non_finite:
            amax = partials.max().item()  # NaN propagates, as it did on the tiles
            raise NonFiniteAmaxError(f"amax is {amax}; cannot choose an FP8 scale for {fmt.name}")

    codes = torch.empty(flat.numel(), dtype=torch.uint8)
    for begin, end in _tile_ranges(flat.numel(), tiles, workers).tolist():
        if end == begin:
            continue
        status = lib.ius_vertex_cast_to_fp8(
            _address(flat, begin), end - begin, dtype, exponent_bits, int(overflow == "saturate"),
            workers, int(log2_scale), _address(codes, begin))
        _check(status, "CastToFp8")
    return EmulatedCast(codes.reshape(x.shape), int(log2_scale), partials)


def cast_from_fp8(
    codes: torch.Tensor,
    fmt: object,
    log2_scale: int,
    dtype: torch.dtype = torch.float32,
    tiles: int = IPU_TILES,
    workers: int = IPU_WORKERS,
) -> torch.Tensor:
    """Run CastFromFp8 on every tile: ``decode(codes) * 2**-log2_scale`` as float32/float16."""
    fmt = get_format(fmt)  # type: ignore[arg-type]
    lib = _host.library()
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    flat = codes.detach().contiguous().reshape(-1)
    out = torch.empty(flat.numel(), dtype=dtype)
    out_dtype = _host.dtype_code(dtype)
    exponent_bits = _host.exponent_bits(fmt.name)
    for begin, end in _tile_ranges(flat.numel(), tiles, workers).tolist():
        if end == begin:
            continue
        status = lib.ius_vertex_cast_from_fp8(_address(flat, begin), end - begin, out_dtype,
                                              exponent_bits, workers, int(log2_scale),
                                              _address(out, begin))
        _check(status, "CastFromFp8")
    return out.reshape(codes.shape)


def quantise(
    x: torch.Tensor,
    fmt: object,
    log2_scale: Optional[int] = None,
    margin: int = 0,
    overflow: str = "saturate",
    tiles: int = IPU_TILES,
    workers: int = IPU_WORKERS,
) -> Tuple[torch.Tensor, int, bool]:
    """The ``Fp8Quantise`` graph, vertex by vertex: ``decode(cast(x * 2**s)) * 2**-s``.

    Returns (values in x's dtype and shape, s, the non-finite flag). As on the IPU, a
    non-finite amax does not raise: ScalingBias writes s = 0 and sets the flag, and the cast
    goes on with s = 0.
    """
    fmt = get_format(fmt)  # type: ignore[arg-type]
    flag = False
    if log2_scale is None:
        partials = partial_amaxes(x, tiles, workers)
        log2_scale, flag = scaling_bias(partials, fmt, margin)
    codes = cast_to_fp8(x, fmt, log2_scale, margin, overflow, tiles, workers).codes
    values = cast_from_fp8(codes, fmt, log2_scale, x.dtype, tiles, workers)
    return values, log2_scale, flag

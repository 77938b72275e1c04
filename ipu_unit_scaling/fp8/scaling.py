"""Per-tensor power-of-two scaling: the AMAX rule and scaled casts.

Sign convention (used everywhere, Python and C++)::

    q = encode(x * 2**s)        x ~= decode(q) * 2**-s
    s = clamp(floor(log2(fmt.max / amax)) - margin, -31, 31)

Poplar's ``QuarterMetadata`` scale is ``-s``.

The scaled cast, bit for bit: ``x`` is converted to float32 (float64 is rounded to float32
first), multiplied by ``2**s`` in float32, then encoded (see :mod:`.codec`). The multiply is
exact except where the product leaves float32's normal range; a product below 2**-126 rounds
to zero in every FP8 format and one that overflows float32 is out of every FP8 range, so the
codes equal those of rounding the exact product once.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple, Union

import torch

from .codec import (
    OVERFLOW_POLICIES,
    ROUNDING_MODES,
    FormatLike,
    as_float32,
    check_choice,
    check_float_tensor,
    decode,
    encode,
)
from .fp8_formats import FP8Format, get_format
from .stats import record_cast, stats_enabled

__all__ = [
    "MAX_LOG2_SCALE", "MAX_MARGIN", "NonFiniteAmaxError", "log2_scale", "Fp8Tensor",
    "cast_to_fp8", "cast_to_fp8_reference", "cast_from_fp8",
]

MAX_LOG2_SCALE = 31
MAX_MARGIN = 31


class NonFiniteAmaxError(ValueError):
    """The absolute maximum of a tensor to be cast is inf or NaN: no scale can be chosen."""


def check_margin(margin: int) -> int:
    if isinstance(margin, bool) or not isinstance(margin, int):
        raise ValueError(f"margin must be an int in 0..{MAX_MARGIN}, got {margin!r}")
    if not 0 <= margin <= MAX_MARGIN:
        raise ValueError(f"margin must be in 0..{MAX_MARGIN}, got {margin}")
    return margin


def check_log2_scale(scale: int) -> int:
    if isinstance(scale, bool) or not isinstance(scale, int):
        raise ValueError(f"log2_scale must be an int or None, got {scale!r}")
    if not -MAX_LOG2_SCALE <= scale <= MAX_LOG2_SCALE:
        raise ValueError(f"log2_scale must be in -{MAX_LOG2_SCALE}..{MAX_LOG2_SCALE}, got {scale}")
    return scale


def log2_scale(amax: Union[float, torch.Tensor], fmt: FormatLike, margin: int = 0) -> int:
    """The scaling bias ``s`` for a tensor whose absolute maximum is ``amax``.

    ``s = clamp(floor(log2(fmt.max / amax)) - margin, -31, 31)``: the largest power of two
    that keeps ``amax * 2**s <= fmt.max``, lowered by ``margin`` (0..31) to leave headroom.
    ``amax == 0`` gives 0; an inf or NaN ``amax`` raises :class:`NonFiniteAmaxError`.
    The floor is computed exactly from the binary exponents, not with a rounded division.
    """
    fmt = get_format(fmt)
    check_margin(margin)
    if isinstance(amax, torch.Tensor):
        if amax.numel() != 1:
            raise ValueError(f"amax must be a scalar, got a tensor of shape {tuple(amax.shape)}")
        amax = amax.item()
    value = float(amax)
    if not math.isfinite(value):
        raise NonFiniteAmaxError(f"amax is {value}; cannot choose an FP8 scale for {fmt.name}")
    if value < 0:
        raise ValueError(f"amax must be >= 0, got {value}")
    if value == 0:
        return 0
    max_mantissa, max_exponent = math.frexp(fmt.max)
    amax_mantissa, amax_exponent = math.frexp(value)
    exponent = max_exponent - amax_exponent - (1 if amax_mantissa > max_mantissa else 0)
    return max(-MAX_LOG2_SCALE, min(MAX_LOG2_SCALE, exponent - margin))


class Fp8Tensor(NamedTuple):
    """FP8 codes with their per-tensor scaling bias: ``value ~= decode(codes) * 2**-log2_scale``."""

    codes: torch.Tensor
    log2_scale: int
    fmt: FP8Format

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return cast_from_fp8(self, dtype)


def _resolve_scale(x32: torch.Tensor, fmt: FP8Format, scale: Optional[int], margin: int) -> int:
    check_margin(margin)
    if scale is not None:
        return check_log2_scale(scale)
    amax = x32.abs().max() if x32.numel() else torch.zeros(())
    return log2_scale(amax, fmt, margin)


def _check_cast_args(overflow: str, rounding: str) -> None:
    check_choice(overflow, OVERFLOW_POLICIES, "overflow policy")
    check_choice(rounding, ROUNDING_MODES, "rounding mode")


def cast_to_fp8_reference(
    x: torch.Tensor,
    fmt: FormatLike,
    log2_scale: Optional[int] = None,
    margin: int = 0,
    overflow: str = "saturate",
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
    backend: str = "auto",
    site: Optional[str] = None,
) -> Fp8Tensor:
    """Pure-torch :func:`cast_to_fp8`; the reference any faster path must match bit for bit."""
    fmt = get_format(fmt)
    _check_cast_args(overflow, rounding)
    x32 = as_float32(x.detach())
    scale = _resolve_scale(x32, fmt, log2_scale, margin)
    scaled = x32 * math.ldexp(1.0, scale)
    codes = encode(scaled, fmt, rounding=rounding, overflow=overflow, generator=generator,
                   backend=backend)
    if stats_enabled():
        record_cast(site, scaled, codes, fmt, scale)
    return Fp8Tensor(codes, scale, fmt)


def _try_host_cast(
    x: torch.Tensor, fmt: FP8Format, scale: Optional[int], margin: int, saturate: bool
) -> Optional[Tuple[torch.Tensor, int]]:
    """The compiled host cast, when it is built and applies to ``x``; else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float16):
        return None
    if not x.is_contiguous():
        return None
    try:
        from . import host_library as _host
    except ImportError:
        return None
    if not _host.fused_cast_available():
        return None
    try:
        return _host.fused_cast_to_fp8(x, fmt.name, scale, margin, saturate)
    except _host.NonFiniteAmax as error:
        raise NonFiniteAmaxError(str(error)) from error


def cast_to_fp8(
    x: torch.Tensor,
    fmt: FormatLike,
    log2_scale: Optional[int] = None,
    margin: int = 0,
    overflow: str = "saturate",
    rounding: str = "nearest",
    generator: Optional[torch.Generator] = None,
    site: Optional[str] = None,
) -> Fp8Tensor:
    """Cast ``x`` to FP8 with a per-tensor power-of-two scale.

    ``log2_scale=None`` computes ``s`` from the tensor's amax now (with ``margin``, see
    :func:`log2_scale`); an int uses that ``s`` (``margin`` is then unused; 0 is a plain cast).
    ``overflow`` is "saturate" or "nan", ``rounding`` "nearest" or "stochastic". ``site``
    names the cast in :func:`fp8_stats` records. Uses the compiled host cast when it is
    available for this input, else :func:`cast_to_fp8_reference`; both give the same codes.
    """
    fmt = get_format(fmt)
    _check_cast_args(overflow, rounding)
    check_float_tensor(x)
    check_margin(margin)
    if log2_scale is not None:
        check_log2_scale(log2_scale)
    if rounding == "nearest":
        host = _try_host_cast(x.detach(), fmt, log2_scale, margin, overflow == "saturate")
        if host is not None:
            codes, scale = host
            if stats_enabled():
                scaled = x.detach().to(torch.float32) * math.ldexp(1.0, scale)
                record_cast(site, scaled, codes, fmt, scale)
            return Fp8Tensor(codes, int(scale), fmt)
    return cast_to_fp8_reference(x, fmt, log2_scale, margin, overflow, rounding, generator,
                                 site=site)


def _try_host_decode(t: Fp8Tensor) -> Optional[torch.Tensor]:
    """The compiled host decode (float32), when it is built and applies to ``t``; else None."""
    try:
        from . import host_library as _host
    except ImportError:
        return None
    return _host.host_decode(t.codes, t.fmt.name, t.log2_scale)


def cast_from_fp8(t: Fp8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(codes) * 2**-log2_scale``, exact in float32, then converted to ``dtype``.

    On CPU, when the host library is built, the decode runs the codelets' CastFromFp8 code
    (bit-identical to the torch path, several times faster).
    """
    if not isinstance(t, Fp8Tensor):
        raise TypeError(f"expected an Fp8Tensor, got {type(t).__name__}")
    if not dtype.is_floating_point:
        raise TypeError(f"FP8 values decode to a floating-point dtype, not {dtype}")
    values = _try_host_decode(t)
    if values is None:
        values = decode(t.codes, t.fmt)
        if t.log2_scale:
            values.mul_(math.ldexp(1.0, -t.log2_scale))
    return values.to(dtype)

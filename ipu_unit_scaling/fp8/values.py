"""FP8 rounding straight to float values: what FP8 simulation needs on a device without FP8.

An FP8 matmul on a CPU multiplies the FP8 values in float32. The codes themselves are never
needed there, so instead of encoding to codes and decoding them back (two passes and a uint8
tensor in between), :func:`quantise_values` produces ``decode(encode(x * 2**s)) * 2**-s``
directly, the same float32 bits as the round trip through :func:`cast_to_fp8` and
:func:`cast_from_fp8`. Three ways, fastest first:

- the host library's fused kernel (F143 and F152, contiguous CPU float32): amax, scale and
  rounding in one pass;
- a round trip through torch's float8 dtype where this torch has the format's (torch 2.1 on;
  saturating overflow only): a clamp, the cast, and back by a table lookup (torch's own
  float8-to-float32 conversion runs scalar code on a CPU, about six times slower);
- the codec reference, ``decode(encode(...))``, anywhere else (torch 2.0 without the host
  library, stochastic rounding, ``overflow="nan"``).

The ``Fp8Tensor`` path (codes and a scale) stays what the IPU, ``torch._scaled_mm`` and the
FP8 custom ops use.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .codec import decode, decode_float8, encode
from .fp8_formats import FP8Format
from .scaling import NonFiniteAmaxError, log2_scale

__all__ = ["quantise_values", "values_path"]

_HOST_FORMATS = ("F143", "F152")


def _host_library():
    try:
        from . import host_library as _host
    except ImportError:
        return None
    return _host if _host.fused_cast_available() else None


def values_path(fmt: FP8Format, overflow: str = "saturate") -> str:
    """Which implementation :func:`quantise_values` uses for contiguous CPU float32 input:
    "host", "torch float8" or "reference"."""
    if fmt.name in _HOST_FORMATS and _host_library() is not None:
        return "host"
    if fmt.torch_dtype is not None and overflow == "saturate":
        return "torch float8"
    return "reference"


def _scale_from_amax(x: torch.Tensor, fmt: FP8Format, margin: int) -> int:
    if not x.numel():
        return 0
    # One pass, no |x| temporary, NaN propagating through both; on a CPU about ten times faster
    # than vector_norm(x, inf) or x.abs().max().
    low, high = torch.aminmax(x)
    return log2_scale(float(torch.maximum(high, -low)), fmt, margin)


def _torch_float8(x: torch.Tensor, fmt: FP8Format, scale: int) -> torch.Tensor:
    dtype = fmt.torch_dtype
    assert dtype is not None
    scaled = x * math.ldexp(1.0, scale) if scale else x
    # Clamp first: torch's own overflow differs between dtypes; saturating is the policy.
    values = torch.clamp(scaled, -fmt.max, fmt.max)
    decode_float8(values.to(dtype), fmt, out=values)
    if scale:
        values.mul_(math.ldexp(1.0, -scale))  # exact: at most four significant bits
    return values


def _reference(x: torch.Tensor, fmt: FP8Format, scale: int, overflow: str) -> torch.Tensor:
    codes = encode(x * math.ldexp(1.0, scale) if scale else x, fmt, overflow=overflow)
    values = decode(codes, fmt)
    return values.mul_(math.ldexp(1.0, -scale)) if scale else values


def quantise_values(x: torch.Tensor, fmt: FP8Format, log2_scale: Optional[int] = None,
                    margin: int = 0, overflow: str = "saturate") -> Tuple[torch.Tensor, int]:
    """(``decode(encode(x * 2**s)) * 2**-s`` as a new float32 tensor, ``s``), rounding to
    nearest even.

    ``x`` is float32 (other dtypes are converted first). ``s`` is ``log2_scale``, or comes
    from the amax with ``margin`` as in :func:`~ipu_unit_scaling.fp8.cast_to_fp8`, which raises
    :class:`NonFiniteAmaxError` for an inf or NaN amax; so does this.
    """
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    saturate = overflow == "saturate"
    if fmt.name in _HOST_FORMATS and x.device.type == "cpu":
        host = _host_library()
        if host is not None:
            values, scale, bad_amax = host.quantise_float32(x.contiguous(), fmt.name, log2_scale,
                                                            margin, saturate)
            if bad_amax is not None:
                raise NonFiniteAmaxError(
                    f"amax is {bad_amax}; cannot choose an FP8 scale for {fmt.name}")
            return values, scale
    scale = _scale_from_amax(x, fmt, margin) if log2_scale is None else log2_scale
    if fmt.torch_dtype is not None and saturate:
        return _torch_float8(x, fmt, scale), scale
    return _reference(x, fmt, scale, overflow), scale

"""PopXL's two float8 formats on the host: ``float8_143`` and ``float8_152``.

1 sign bit, then 4 exponent and 3 mantissa bits (bias 8) or 5 and 2 (bias 16): the IPU's
formats (popart ``float8_143``/``float8_152``). Code 0x80 is the one NaN; there is no infinity
and no negative zero. A cast rounds to nearest, ties to the even code, and gives the NaN for a
value whose rounding passes the largest finite value (the IPU's NaN-on-overflow), for
infinities and for NaN.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["Float8Format", "F143", "F152", "encode", "decode"]

_NAN_CODE = 0x80


class Float8Format:
    """One float8 format: its name, field widths and exponent bias."""

    def __init__(self, name: str, exponent_bits: int, mantissa_bits: int, bias: int):
        self.name = name
        self.exponent_bits = exponent_bits
        self.mantissa_bits = mantissa_bits
        self.bias = bias
        self.magnitudes = tuple(self._magnitude(code) for code in range(128))

    def _magnitude(self, code: int) -> float:
        exponent, mantissa = code >> self.mantissa_bits, code & ((1 << self.mantissa_bits) - 1)
        if exponent == 0:  # subnormal: no implicit leading one
            return math.ldexp(mantissa, 1 - self.bias - self.mantissa_bits)
        return math.ldexp((1 << self.mantissa_bits) + mantissa,
                          exponent - self.bias - self.mantissa_bits)

    def tables(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The 128 magnitudes (float64, ascending with the code) and the 128 midpoints above
        each (the last one: where rounding passes the largest value)."""
        values = torch.tensor(self.magnitudes, dtype=torch.float64, device=device)
        top = values[-1] + (values[-1] - values[-2]) / 2
        midpoints = torch.cat([(values[:-1] + values[1:]) / 2, top.reshape(1)])
        return values, midpoints

    def __repr__(self) -> str:
        return f"float8_1{self.exponent_bits}{self.mantissa_bits}"


F143 = Float8Format("F143", 4, 3, 8)
F152 = Float8Format("F152", 5, 2, 16)


def encode(x: torch.Tensor, fmt: Float8Format) -> torch.Tensor:
    """The codes (uint8) of ``x`` in ``fmt``, rounded to nearest, ties to even; NaN where the
    rounding overflows, for infinities and for NaN."""
    magnitude = x.double().abs()  # exact: every float32 value is a float64 value
    _, midpoints = fmt.tables(x.device)
    code = torch.searchsorted(midpoints, magnitude.reshape(-1)).reshape(x.shape)
    below = midpoints[code.clamp(max=127)]
    tie = (code < 128) & (magnitude == below)
    code = torch.where(tie & (code % 2 == 1), code + 1, code)
    overflow = (code >= 128) | torch.isnan(magnitude)
    sign = torch.where(torch.signbit(x) & (code != 0), 0x80, 0)
    codes = torch.where(overflow, torch.full_like(code, _NAN_CODE), code | sign)
    return codes.to(torch.uint8)


def decode(codes: torch.Tensor, fmt: Float8Format) -> torch.Tensor:
    """The float32 values of ``codes`` (uint8) in ``fmt``."""
    values, _ = fmt.tables(codes.device)
    table = torch.cat([values, -values]).float()
    table[_NAN_CODE] = math.nan
    return table[codes.long()]

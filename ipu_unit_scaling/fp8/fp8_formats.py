"""FP8 formats (and the narrower element formats of block recipes) as data.

Each format is described by its field widths, exponent bias and special-value encoding; every
other property (the value of each code, the largest finite code, the rounding threshold above
which a value overflows) is derived from those few facts.

IPU formats (Graphcore "1.4.3" and "1.5.2") are bit-identical to the ``fnuz`` dtypes: one NaN
code (0x80), no infinities, no negative zero. The OCP formats are the ones GPUs use. The OCP
Microscaling (MX v1.0) element formats E2M1 (FP4), E2M3 and E3M2 (FP6) have no NaN and no
infinity; their codes sit in the low bits of a uint8, sign bit highest (``ml_dtypes``'
``float4_e2m1fn``, ``float6_e2m3fn``, ``float6_e3m2fn`` byte for byte).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch

__all__ = ["FP8Format", "F143", "F152", "E4M3FN", "E5M2", "E2M1", "E2M3", "E3M2", "FORMATS",
           "SUB_BYTE_FORMATS", "get_format"]


@dataclass(frozen=True)
class FP8Format:
    """A floating-point format of ``1 + exponent_bits + mantissa_bits`` bits (8 for FP8, 6 or 4
    for the MX element formats): 1 sign bit, ``exponent_bits``, ``mantissa_bits``.

    ``nan_codes`` lists every code that decodes to NaN (none for the MX element formats);
    ``has_inf`` says whether the all-ones exponent with zero mantissa encodes +-inf (IEEE
    style). When a format has no negative zero, the sign bit alone (0x80) is not -0.0 (for the
    fnuz formats it is the NaN). ``torch_dtype_name`` is "" where torch has no such dtype.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool
    has_negative_zero: bool
    nan_codes: Tuple[int, ...]
    torch_dtype_name: str
    # The decoded value of every code (float64, NaN for NaN codes), filled in by __post_init__.
    values: Tuple[float, ...] = field(init=False, repr=False, compare=False)
    # Code of the largest finite positive value (sign bit clear), filled in by __post_init__.
    max_code: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 3 <= self.exponent_bits + self.mantissa_bits <= 7:
            raise ValueError(f"{self.name}: exponent_bits + mantissa_bits must be 3 to 7")
        values = tuple(self._decode_code(c) for c in range(2 * self.sign_bit))
        finite = [c for c in range(self.sign_bit) if math.isfinite(values[c])]
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "max_code", max(finite, key=lambda c: values[c]))

    def _decode_code(self, code: int) -> float:
        if code in self.nan_codes:
            return math.nan
        m = self.mantissa_bits
        sign = -1.0 if code & self.sign_bit else 1.0
        exponent_field = (code >> m) & ((1 << self.exponent_bits) - 1)
        mantissa_field = code & ((1 << m) - 1)
        if self.has_inf and exponent_field == (1 << self.exponent_bits) - 1 and mantissa_field == 0:
            return sign * math.inf
        if exponent_field == 0:  # subnormal: no implicit leading one
            return sign * math.ldexp(mantissa_field, 1 - self.bias - m)
        return sign * math.ldexp((1 << m) + mantissa_field, exponent_field - self.bias - m)

    # Derived facts. Properties rather than fields so that they can never disagree.
    @property
    def bits(self) -> int:
        """Bits per code: sign, exponent and mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def sign_bit(self) -> int:
        """The code's sign bit: 0x80 for FP8, 0x20 for FP6, 0x08 for FP4."""
        return 1 << (self.exponent_bits + self.mantissa_bits)

    @property
    def max_exponent(self) -> int:
        """Unbiased exponent of the largest finite value (``emax`` of OCP MX)."""
        return math.frexp(self.max)[1] - 1

    @property
    def max(self) -> float:
        """Largest finite value."""
        return self.values[self.max_code]

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2**(1 - bias)."""
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, 2**(1 - bias - mantissa_bits)."""
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def min_exponent(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def overflow_threshold(self) -> float:
        """Half-way point between max and the next value the exponent range would give.

        A magnitude above it overflows under round-to-nearest; a magnitude equal to it
        overflows only when max has an odd mantissa (ties go to even).
        """
        ulp_at_max = math.ldexp(1.0, math.frexp(self.max)[1] - 1 - self.mantissa_bits)
        return self.max + ulp_at_max / 2

    @property
    def tie_at_threshold_overflows(self) -> bool:
        return bool(self.max_code & 1)

    @property
    def inf_code(self) -> Optional[int]:
        """Code of +inf (sign bit clear), or None."""
        return (((1 << self.exponent_bits) - 1) << self.mantissa_bits) if self.has_inf else None

    def nan_code(self, negative: bool = False) -> int:
        """The code a NaN input is encoded to (sign kept where the format has signed NaNs).

        ValueError for a format without NaN (the MX element formats)."""
        if not self.nan_codes:
            raise ValueError(f"{self.name} has no NaN code")
        if len(self.nan_codes) == 1:
            return self.nan_codes[0]
        # Quiet NaN: all-ones exponent, leading mantissa bit set (E5M2: 0x7e; E4M3FN: 0x7f).
        positive = [c for c in self.nan_codes if c < self.sign_bit]
        quiet = min(c for c in positive if c & (1 << (self.mantissa_bits - 1)))
        return quiet | self.sign_bit if negative else quiet

    def overflow_code(self, negative: bool = False) -> int:
        """The code a finite overflow or an infinity gets under the "nan" overflow policy.

        Infinity where the format has one (E5M2), otherwise NaN.
        """
        if self.inf_code is not None:
            return self.inf_code | self.sign_bit if negative else self.inf_code
        return self.nan_code(negative)

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The matching torch float8 dtype, or None on a torch without it (e.g. 2.0.1)."""
        return getattr(torch, self.torch_dtype_name, None) if self.torch_dtype_name else None

    def __str__(self) -> str:
        return self.name


F143 = FP8Format(
    name="F143", exponent_bits=4, mantissa_bits=3, bias=8, has_inf=False,
    has_negative_zero=False, nan_codes=(0x80,), torch_dtype_name="float8_e4m3fnuz",
)
F152 = FP8Format(
    name="F152", exponent_bits=5, mantissa_bits=2, bias=16, has_inf=False,
    has_negative_zero=False, nan_codes=(0x80,), torch_dtype_name="float8_e5m2fnuz",
)
E4M3FN = FP8Format(
    name="E4M3FN", exponent_bits=4, mantissa_bits=3, bias=7, has_inf=False,
    has_negative_zero=True, nan_codes=(0x7F, 0xFF), torch_dtype_name="float8_e4m3fn",
)
E5M2 = FP8Format(
    name="E5M2", exponent_bits=5, mantissa_bits=2, bias=15, has_inf=True,
    has_negative_zero=True, nan_codes=(0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF),
    torch_dtype_name="float8_e5m2",
)

# OCP MX v1.0 element formats: no infinities, no NaN (a block's NaN lives in its scale).
E2M1 = FP8Format(
    name="E2M1", exponent_bits=2, mantissa_bits=1, bias=1, has_inf=False,
    has_negative_zero=True, nan_codes=(), torch_dtype_name="",
)
E2M3 = FP8Format(
    name="E2M3", exponent_bits=2, mantissa_bits=3, bias=1, has_inf=False,
    has_negative_zero=True, nan_codes=(), torch_dtype_name="",
)
E3M2 = FP8Format(
    name="E3M2", exponent_bits=3, mantissa_bits=2, bias=3, has_inf=False,
    has_negative_zero=True, nan_codes=(), torch_dtype_name="",
)

FORMATS: Dict[str, FP8Format] = {
    f.name: f for f in (F143, F152, E4M3FN, E5M2, E2M1, E2M3, E3M2)
}
# Narrower than a byte: element formats of the block recipes ("mx", "nvfp4") only.
SUB_BYTE_FORMATS = ("E2M1", "E2M3", "E3M2")


def get_format(fmt: Union[str, FP8Format]) -> FP8Format:
    """Look a format up by name ("F143", "F152", "E4M3FN", "E5M2", "E2M1", "E2M3", "E3M2"; any
    case) or pass one through."""
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, str):
        found = FORMATS.get(fmt.upper())
        if found is not None:
            return found
    valid: List[str] = list(FORMATS)
    raise ValueError(f"unknown FP8 format {fmt!r}; valid formats are {', '.join(valid)}")

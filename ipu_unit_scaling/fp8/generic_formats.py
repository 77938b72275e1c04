"""Generic floating-point formats for simulating low precision: `FPFormat(exponent_bits,
mantissa_bits)`.

A format's normal numbers have exponents from ``1 - 2**(E - 1)`` to ``2**(E - 1) - 1`` and M
mantissa bits, below them subnormals spaced like the smallest normals, and no infinities:
``FPFormat(4, 3)`` is the IPU's F143 (E4M3, max 240) and ``FPFormat(5, 2)`` its F152 (E5M2, max
57344). Quantising saturates to the largest magnitude, then rounds to the format's grid: to the
nearest value (ties to even) or stochastically (up with the probability of the distance from
the value below, drawn from ``srbits`` random bits; 0 means all the bits a float32 mantissa has
below the format's). The result is returned in the input's dtype, computed in float32 or wider.

For FP8 with per-tensor scaling (FP8-AMAX) see :mod:`ipu_unit_scaling.fp8`; this module is the
plain cast that unit scaling makes possible, as
:func:`ipu_unit_scaling.transforms.simulate_fp8` applies it.

Under :func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing` (and while PopTorch traces) the
casts take their PopTorch form, whose gradients come from the forward graph alone:
``quantise_fwd`` is the cast's value plus ``x - x.detach()`` (the same values, a straight-through
gradient), its exponent found with ``log2`` and ``pow`` (PopTorch has no ``frexp`` or ``exp2``);
``quantise_bwd`` is the FP8 gradient-cast custom op with scale 1 (the IPU's F143 or F152 cast,
saturating, rounded to nearest), so it takes E4M3 and E5M2 only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import torch
from torch import Tensor

from ..ops import trace_switch as tracing

__all__ = ["FPFormat", "Shape", "format_to_tuple", "tuple_to_format"]

Shape = Tuple[int, ...]  # a tensor shape (unit-scaling's ``formats.Shape``)

_FLOAT32_MANTISSA_BITS = 23


@dataclass
class FPFormat:
    """A floating-point format: exponent and mantissa bits, and how values round into it."""

    exponent_bits: int
    mantissa_bits: int
    rounding: str = "stochastic"  # "stochastic" or "nearest"
    srbits: int = 0  # random bits for stochastic rounding; 0: all below the format's mantissa

    def __post_init__(self) -> None:
        if self.exponent_bits < 2:
            raise ValueError(f"exponent_bits={self.exponent_bits} must be at least 2")
        if not 0 <= self.mantissa_bits < _FLOAT32_MANTISSA_BITS:
            raise ValueError(f"mantissa_bits={self.mantissa_bits} must be in [0, 23)")
        if self.rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding={self.rounding!r} must be 'stochastic' or 'nearest'")
        if self.srbits and self.rounding != "stochastic":
            raise ValueError("srbits is only for stochastic rounding")
        if self.rounding == "stochastic" and self.srbits == 0:
            self.srbits = _FLOAT32_MANTISSA_BITS - self.mantissa_bits

    @property
    def bits(self) -> int:
        """Bits per value: sign, exponent and mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    def __str__(self) -> str:
        suffix = "SR" if self.rounding == "stochastic" else "RN"
        return f"E{self.exponent_bits}M{self.mantissa_bits}-{suffix}"

    @property
    def _max_exponent(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def _min_exponent(self) -> int:
        return 1 - 2 ** (self.exponent_bits - 1)

    @property
    def max_absolute_value(self) -> float:
        """The largest finite magnitude."""
        return 2.0**self._max_exponent * (2 - 2.0**-self.mantissa_bits)

    @property
    def min_absolute_normal(self) -> float:
        """The smallest normal magnitude."""
        return 2.0**self._min_exponent

    @property
    def min_absolute_subnormal(self) -> float:
        """The smallest non-zero magnitude."""
        return self.min_absolute_normal * 2.0**-self.mantissa_bits

    def quantise(self, x: Tensor) -> Tensor:
        """`x` saturated and rounded to this format (not differentiable)."""
        wide = x.detach()
        if wide.dtype not in (torch.float32, torch.float64):
            wide = wide.float()
        wide = wide.clamp(-self.max_absolute_value, self.max_absolute_value)
        _, exponent = torch.frexp(wide)  # |x| = m 2**e with m in [0.5, 1)
        exponent = (exponent - 1).clamp(min=self._min_exponent)
        spacing = torch.exp2((exponent - self.mantissa_bits).to(wide.dtype))
        steps = wide / spacing  # exact: a power-of-two division
        if self.rounding == "nearest":
            steps = torch.round(steps)
        else:
            draws = torch.randint(0, 2**self.srbits, wide.shape, device=wide.device)
            uniform = (draws.to(wide.dtype) + 0.5) * 2.0**-self.srbits
            steps = torch.floor(steps + uniform)
        return (steps * spacing).to(x.dtype)

    def quantise_fwd(self, x: Tensor) -> Tensor:
        """Quantised in the forward pass; the gradient passes through unchanged."""
        if tracing.is_ipu_tracing():
            return self._traced_quantise(x) + (x - x.detach())
        return _QuantiseForward.apply(x, self)  # type: ignore[no-any-return]

    def quantise_bwd(self, x: Tensor) -> Tensor:
        """Unchanged in the forward pass; the gradient is quantised."""
        if tracing.is_ipu_tracing():
            from .cast_ops import fp8_quantise_gradient

            return fp8_quantise_gradient(x, self._ipu_format(), margin=0, saturate=True,
                                         log2_scale=0)
        return _QuantiseBackward.apply(x, self)  # type: ignore[no-any-return]

    def _traced_quantise(self, x: Tensor) -> Tensor:
        """:meth:`quantise`'s values from ops PopTorch has (no ``frexp``, no ``exp2``)."""
        wide = x.detach()
        if wide.dtype not in (torch.float32, torch.float64):
            wide = wide.float()
        wide = wide.clamp(-self.max_absolute_value, self.max_absolute_value)
        magnitude = wide.abs()
        lowest = float(self._min_exponent)
        exponent = torch.floor(torch.log2(magnitude)).clamp(lowest, float(self._max_exponent))
        # log2 may round across an integer next to a power of two: step back into the binade.
        exponent = torch.where(torch.pow(2.0, exponent) > magnitude, exponent - 1, exponent)
        exponent = torch.where(torch.pow(2.0, exponent + 1) <= magnitude, exponent + 1, exponent)
        spacing = torch.pow(2.0, exponent.clamp(min=lowest) - self.mantissa_bits).to(wide.dtype)
        steps = wide / spacing  # exact: a power-of-two division
        if self.rounding == "nearest":
            steps = torch.round(steps)
        else:
            draws = torch.randint(0, 2**self.srbits, wide.shape, device=wide.device)
            uniform = (draws.to(wide.dtype) + 0.5) * 2.0**-self.srbits
            steps = torch.floor(steps + uniform)
        return (steps * spacing).to(x.dtype)

    def _ipu_format(self) -> str:
        """The IPU's FP8 format with this grid, for the gradient cast's custom op."""
        grids = {(4, 3): "F143", (5, 2): "F152"}
        name = grids.get((self.exponent_bits, self.mantissa_bits))
        if name is None:
            raise NotImplementedError(
                f"{self}: a gradient cast has a PopTorch form for E4M3 and E5M2 only (the IPU's "
                "F143 and F152 custom op)")
        return name


class _QuantiseForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fmt: FPFormat) -> Tensor:
        return fmt.quantise(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return grad, None


class _QuantiseBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fmt: FPFormat) -> Tensor:
        ctx.fmt = fmt
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return ctx.fmt.quantise(grad), None


def format_to_tuple(format: FPFormat) -> Tuple[int, int]:
    """(exponent_bits, mantissa_bits) of a format."""
    return (format.exponent_bits, format.mantissa_bits)


def tuple_to_format(t: Tuple[int, int]) -> FPFormat:
    """The format with (exponent_bits, mantissa_bits) and default (stochastic) rounding."""
    return FPFormat(*t)

"""FP8Config: which format, scaling and rounding each role of an FP8 matmul uses."""
from __future__ import annotations

from dataclasses import dataclass

from .codec import OVERFLOW_POLICIES, ROUNDING_MODES
from .formats import FP8Format, get_format
from .scaling import MAX_MARGIN

__all__ = ["FP8Config", "SCALING_MODES"]

SCALING_MODES = ("amax", "static")


@dataclass(frozen=True)
class FP8Config:
    """How :func:`simulate_fp8` and the FP8 modules cast.

    - ``*_format``: "F143", "F152", "E4M3FN" or "E5M2" for activations (matmul inputs),
      weights, and output gradients.
    - ``scaling``: "amax" picks each tensor's scale from its absolute max at every cast, lowered
      by the role's margin (0..31); "static" casts with scale 0 (``2**0``), which is enough when
      unit scaling keeps tensors near unit variance.
    - ``rounding``: "nearest" (to even) or "stochastic"; ``overflow``: "saturate" or "nan".
    - ``attention``: also cast the operands of attention's two matmuls (see
      :func:`fp8_attention`).
    """

    activation_format: str = "F143"
    weight_format: str = "F143"
    gradient_format: str = "F152"
    scaling: str = "amax"
    activation_margin: int = 0
    weight_margin: int = 0
    gradient_margin: int = 3
    rounding: str = "nearest"
    overflow: str = "saturate"
    attention: bool = False

    def __post_init__(self) -> None:
        for role in ("activation", "weight", "gradient"):
            get_format(getattr(self, f"{role}_format"))  # ValueError naming the valid ones
            margin = getattr(self, f"{role}_margin")
            if isinstance(margin, bool) or not isinstance(margin, int):
                raise ValueError(f"{role}_margin must be an int, got {margin!r}")
            if not 0 <= margin <= MAX_MARGIN:
                raise ValueError(f"{role}_margin must be in 0..{MAX_MARGIN}, got {margin}")
        _check("scaling", self.scaling, SCALING_MODES)
        _check("rounding", self.rounding, ROUNDING_MODES)
        _check("overflow", self.overflow, OVERFLOW_POLICIES)
        if not isinstance(self.attention, bool):
            raise ValueError(f"attention must be a bool, got {self.attention!r}")

    @property
    def activation(self) -> FP8Format:
        return get_format(self.activation_format)

    @property
    def weight(self) -> FP8Format:
        return get_format(self.weight_format)

    @property
    def gradient(self) -> FP8Format:
        return get_format(self.gradient_format)


def _check(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"FP8Config.{name} must be one of {', '.join(choices)}, got {value!r}")

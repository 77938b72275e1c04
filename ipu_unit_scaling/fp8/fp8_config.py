"""FP8Config: which format, scaling and rounding each role of an FP8 matmul uses.

It is also the ``precision.fp8`` section of a run config
(``ipu_unit_scaling.training.run_config``): one
definition, one set of rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .codec import OVERFLOW_POLICIES, ROUNDING_MODES
from .fp8_formats import FP8Format, get_format
from .scaling import MAX_MARGIN

__all__ = ["FP8Config", "FP8ConfigError", "SCALING_MODES"]

SCALING_MODES = ("amax", "static")


class FP8ConfigError(ValueError):
    """Invalid FP8Config fields; ``problems`` lists (field name, message) pairs."""

    def __init__(self, problems: Sequence[Tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{name}: {message}" for name, message in self.problems))


@dataclass(frozen=True)
class FP8Config:
    """How :func:`ipu_unit_scaling.transforms.simulate_fp8` and the FP8 modules cast.

    - ``*_format``: "F143", "F152", "E4M3FN" or "E5M2" for activations (matmul inputs),
      weights, and output gradients.
    - ``scaling``: "amax" picks each tensor's scale from its absolute max at every cast, lowered
      by the role's margin (0..31); "static" casts with scale 0 (``2**0``), which is enough when
      unit scaling keeps tensors near unit variance.
    - ``rounding``: "nearest" (to even) or "stochastic"; ``overflow``: "saturate" or "nan".
    - ``attention``: also cast the operands of attention's two matmuls (see
      :func:`fp8_attention`).

    Invalid fields raise :class:`FP8ConfigError` (a ValueError) naming each of them.
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
        problems: List[Tuple[str, str]] = []
        for role in ("activation", "weight", "gradient"):
            name = f"{role}_format"
            try:
                get_format(getattr(self, name))
            except ValueError as error:
                problems.append((name, str(error)))
            name = f"{role}_margin"
            margin = getattr(self, name)
            if isinstance(margin, bool) or not isinstance(margin, int):
                problems.append((name, f"got {margin!r}; expected an int"))
            elif not 0 <= margin <= MAX_MARGIN:
                problems.append((name, f"got {margin}; allowed: 0 .. {MAX_MARGIN}"))
        for name, choices in (("scaling", SCALING_MODES), ("rounding", ROUNDING_MODES),
                              ("overflow", OVERFLOW_POLICIES)):
            value = getattr(self, name)
            if value not in choices:
                problems.append((name, f"got {value!r}; allowed: {', '.join(choices)}"))
        if not isinstance(self.attention, bool):
            problems.append(("attention", f"got {self.attention!r}; expected a bool"))
        if problems:
            raise FP8ConfigError(problems)

    @property
    def activation(self) -> FP8Format:
        return get_format(self.activation_format)

    @property
    def weight(self) -> FP8Format:
        return get_format(self.weight_format)

    @property
    def gradient(self) -> FP8Format:
        return get_format(self.gradient_format)

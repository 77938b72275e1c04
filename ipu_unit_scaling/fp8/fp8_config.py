"""FP8Config: which format, scaling and rounding each role of an FP8 matmul uses.

It is also the ``precision.fp8`` section of a run config
(``ipu_unit_scaling.training.run_config``): one
definition, one set of rules.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .codec import OVERFLOW_POLICIES, ROUNDING_MODES
from .fp8_formats import SUB_BYTE_FORMATS, FP8Format, get_format
from .scaling import MAX_MARGIN

__all__ = ["FP8Config", "FP8ConfigError", "SCALING_MODES", "GROUPED_SCALINGS", "RECIPES",
           "MAX_AMAX_HISTORY", "RECIPE_ONLY_FIELDS", "RECIPE_TUNING_FIELDS", "field_is_free"]

SCALING_MODES = ("amax", "static", "delayed", "rowwise", "block", "mx", "nvfp4")
# Recipes whose scales belong to groups of a tensor (rows, tiles, blocks), cast per GEMM along
# that GEMM's reduction dimension (:mod:`.recipe_linear`).
GROUPED_SCALINGS = ("rowwise", "block", "mx", "nvfp4")
AMAX_REDUCTIONS = ("max", "most_recent")
SCALE_ROUNDINGS = ("floor", "up")
MAX_AMAX_HISTORY = 1024
# The block size each block recipe takes when ``block_size`` is None; "mx" and "nvfp4" fix it.
DEFAULT_BLOCK_SIZES = {"block": 128, "mx": 32, "nvfp4": 16}
_FIXED_BLOCK_SIZES = {"mx": 32, "nvfp4": 16}
_OCP_FP8 = {"activation_format": "E4M3FN", "weight_format": "E4M3FN", "gradient_format": "E5M2"}
_FP4 = {"activation_format": "E2M1", "weight_format": "E2M1", "gradient_format": "E2M1"}
# Recipe names (``FP8Config.from_recipe``): each sets the fields it names and resets the other
# recipe fields to their defaults. "mx" is OCP MXFP8 (E4M3 forward, E5M2 gradients).
RECIPES: Dict[str, Dict[str, Any]] = {
    "static": {"scaling": "static"},
    "amax": {"scaling": "amax"},
    "delayed": {"scaling": "delayed"},
    "rowwise": {"scaling": "rowwise"},
    "rowwise_with_gw_hp": {"scaling": "rowwise", "grad_weight_high_precision": True},
    "block": {"scaling": "block"},
    "mx": {"scaling": "mx", **_OCP_FP8},
    "mx_round_up": {"scaling": "mx", "scale_rounding": "up", **_OCP_FP8},
    "mxfp4": {"scaling": "mx", **_FP4},
    "nvfp4": {"scaling": "nvfp4", **_FP4},
}
_RECIPE_FIELDS = ("scaling", "block_size", "scale_rounding", "grad_weight_high_precision",
                  "activation_format", "weight_format", "gradient_format")
# The fields only some scalings read, and which. Away from its default under any other scaling
# such a field would do nothing: it is refused. (A block size is free under "block" only.)
RECIPE_ONLY_FIELDS: Dict[str, Tuple[str, ...]] = {
    "amax_history_length": ("delayed",),
    "amax_reduction": ("delayed",),
    "block_size": ("block", "mx", "nvfp4"),
    "scale_rounding": ("mx",),
    "grad_weight_high_precision": GROUPED_SCALINGS,
}
# Read by some scalings only, and set by no recipe name: a recipe keeps them where it reads them.
RECIPE_TUNING_FIELDS = ("amax_history_length", "amax_reduction", "block_size")


def field_is_free(name: str, scaling: str) -> bool:
    """Whether scaling ``scaling`` reads field ``name`` and lets it be set (every field but
    those of :data:`RECIPE_ONLY_FIELDS`, which only their scalings read; "mx" and "nvfp4" fix
    their block sizes)."""
    if name == "block_size":
        return scaling not in _FIXED_BLOCK_SIZES and scaling in DEFAULT_BLOCK_SIZES
    return scaling in RECIPE_ONLY_FIELDS.get(name, (scaling,))


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
    - ``*_format``: also "E2M1", "E2M3", "E3M2" (OCP MX's FP4 and FP6 elements) with the
      block recipes "mx" and "nvfp4" (which takes E2M1 only).
    - ``scaling``, the recipe (each power-of-two scale is ``2**s`` with the package's sign
      convention, ``q = cast(x * 2**s)``):

      - "static": scale 0 (``2**0``), enough when unit scaling keeps tensors near unit variance;
      - "amax": each tensor's scale from its absolute max at every cast, lowered by the role's
        margin (0..31);
      - "delayed": the AMAX rule applied to the max (``amax_reduction="max"``) or the latest
        (``"most_recent"``) of the amaxes of the role's previous ``amax_history_length`` casts,
        kept in the FP8 layer's ``amax_history`` buffer (so checkpointed);
      - "rowwise": the AMAX rule per row of each GEMM operand along the GEMM's reduction
        dimension;
      - "block": the AMAX rule per 1 x ``block_size`` tile (default 128) of activations and
        gradients along each GEMM's reduction dimension, per ``block_size`` squared block of
        weights;
      - "mx": OCP MX v1.0, 32-element blocks along the reduction dimension sharing an E8M0
        scale, ``floor(log2(amax))`` minus the element format's largest exponent
        (``scale_rounding="floor"``) or the smallest that needs no saturation (``"up"``);
        elements saturate;
      - "nvfp4": 16-element E2M1 blocks, each with an E4M3 scale, and one float32 scale per
        tensor.

      Margins apply to the AMAX-rule recipes (all but "mx" and "nvfp4").
      ``grad_weight_high_precision`` keeps the weight-gradient GEMM in float32 (torchao's
      "rowwise_with_gw_hp"; grouped recipes only).
    - ``rounding``: "nearest" (to even) or "stochastic"; ``overflow``: "saturate" or "nan"
      ("saturate" only for "mx" and "nvfp4").
    - ``attention``: also cast the operands of attention's two matmuls (see
      :func:`fp8_attention`; "static" and "amax" only).

    Invalid fields raise :class:`FP8ConfigError` (a ValueError) naming each of them.
    :meth:`from_recipe` builds a config from a recipe name (:data:`RECIPES`).
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
    amax_history_length: int = 16
    amax_reduction: str = "max"
    block_size: Optional[int] = None
    scale_rounding: str = "floor"
    grad_weight_high_precision: bool = False

    @classmethod
    def from_recipe(cls, name: str, **fields: Any) -> FP8Config:
        """The config of recipe ``name`` (a key of :data:`RECIPES`), other fields from
        ``fields``."""
        return cls(**fields).with_recipe(name)

    def with_recipe(self, name: str) -> FP8Config:
        """This config set to recipe ``name``: its fields, and the other recipe fields
        (scaling, scale rounding, high-precision weight gradient, formats) at their defaults.
        The block size and the amax history, which no recipe name sets, are kept where the
        recipe reads them ("block", "delayed") and otherwise go back to their defaults."""
        if name not in RECIPES:
            raise FP8ConfigError([("recipe", f"got {name!r}; allowed: {', '.join(RECIPES)}")])
        defaults = FP8Config()
        scaling = RECIPES[name]["scaling"]
        changes = {field: getattr(defaults, field) for field in _RECIPE_FIELDS}
        for field in RECIPE_TUNING_FIELDS:
            changes[field] = getattr(self if field_is_free(field, scaling) else defaults, field)
        changes.update(RECIPES[name])
        return dataclasses.replace(self, **changes)

    @property
    def grouped(self) -> bool:
        """Whether the recipe scales groups of a tensor (rows, tiles, blocks)."""
        return self.scaling in GROUPED_SCALINGS

    @property
    def group_size(self) -> Optional[int]:
        """Elements per group along the reduction dimension ("block", "mx", "nvfp4")."""
        if self.block_size is not None:
            return self.block_size
        return DEFAULT_BLOCK_SIZES.get(self.scaling)

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
        problems.extend(self._recipe_problems())
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

    def _recipe_problems(self) -> List[Tuple[str, str]]:
        """What the recipe fields, and the formats and policies a recipe can use, get wrong."""
        problems: List[Tuple[str, str]] = []
        scaling = self.scaling
        length = self.amax_history_length
        if isinstance(length, bool) or not isinstance(length, int):
            problems.append(("amax_history_length", f"got {length!r}; expected an int"))
        elif not 1 <= length <= MAX_AMAX_HISTORY:
            problems.append(("amax_history_length",
                             f"got {length}; allowed: 1 .. {MAX_AMAX_HISTORY}"))
        for name, choices in (("amax_reduction", AMAX_REDUCTIONS),
                              ("scale_rounding", SCALE_ROUNDINGS)):
            if getattr(self, name) not in choices:
                problems.append((name, f"got {getattr(self, name)!r}; allowed: "
                                       f"{', '.join(choices)}"))
        if self.scale_rounding == "up" and scaling != "mx":
            problems.append(("scale_rounding", f"'up' is for scaling 'mx' (E8M0 scales), not "
                                               f"{scaling!r}"))
        if not isinstance(self.grad_weight_high_precision, bool):
            problems.append(("grad_weight_high_precision",
                             f"got {self.grad_weight_high_precision!r}; expected a bool"))
        elif self.grad_weight_high_precision and scaling not in GROUPED_SCALINGS:
            problems.append(("grad_weight_high_precision",
                             f"is for the grouped recipes ({', '.join(GROUPED_SCALINGS)}), "
                             f"not {scaling!r}"))
        size = self.block_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                problems.append(("block_size", f"got {size!r}; expected a positive int"))
            elif scaling in _FIXED_BLOCK_SIZES and size != _FIXED_BLOCK_SIZES[scaling]:
                problems.append(("block_size", f"got {size}; scaling {scaling!r} fixes it at "
                                               f"{_FIXED_BLOCK_SIZES[scaling]}"))
            elif scaling not in DEFAULT_BLOCK_SIZES:
                problems.append(("block_size", f"got {size}; scaling {scaling!r} has no blocks "
                                               "(block, mx and nvfp4 have)"))
        not_e2m1 = []
        for role in ("activation", "weight", "gradient"):
            name = f"{role}_format"
            value = getattr(self, name)
            if not isinstance(value, str) and not isinstance(value, FP8Format):
                continue
            fmt_name = str(value).upper()
            if scaling == "nvfp4" and fmt_name != "E2M1":
                not_e2m1.append(name)
            elif fmt_name in SUB_BYTE_FORMATS and scaling not in ("mx", "nvfp4"):
                problems.append((name, f"{fmt_name} has no NaN nor infinity and needs a block "
                                       f"scale: use scaling 'mx' or 'nvfp4', not {scaling!r}"))
        if not_e2m1:  # one problem, saying what to set
            names = ", ".join(not_e2m1[:-1]) + (" and " if len(not_e2m1) > 1 else "") + \
                not_e2m1[-1]
            got = ", ".join(str(getattr(self, name)) for name in not_e2m1)
            problems.append(("scaling", f"'nvfp4' takes E2M1 elements: also set {names} to "
                                        f"E2M1 (got {got})"))
        for name, scalings in RECIPE_ONLY_FIELDS.items():
            value = getattr(self, name)
            if name != "block_size" and scaling not in scalings and \
                    value != _default(name) and \
                    not any(name == problem for problem, _ in problems):
                problems.append((name, f"got {value!r}; only scaling {' or '.join(scalings)} "
                                       f"reads it, not {scaling!r}: leave it at its default "
                                       f"{_default(name)!r}"))
        if scaling in ("mx", "nvfp4") and self.overflow != "saturate":
            problems.append(("overflow", f"scaling {scaling!r} saturates its elements (OCP "
                                         "MX); got {!r}".format(self.overflow)))
        if self.attention is True and scaling not in ("static", "amax"):
            problems.append(("attention", f"FP8 attention casts per tensor (static or amax), "
                                          f"not with scaling {scaling!r}"))
        return problems


def _default(name: str) -> Any:
    """The default of FP8Config's field ``name``."""
    return FP8Config.__dataclass_fields__[name].default

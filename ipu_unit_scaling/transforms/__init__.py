"""Model-to-model transforms: `unit_scale(model)` converts an existing model to unit scaling."""
from __future__ import annotations

from .replacements import UnitAttention, UnitConv1D, UnitMultiheadAttention
from .unit_scale import UnitScaleReport, UnitScaleWarning, unit_scale, unit_scale_with_report

__all__ = [
    "unit_scale",
    "unit_scale_with_report",
    "UnitScaleReport",
    "UnitScaleWarning",
    "UnitMultiheadAttention",
    "UnitAttention",
    "UnitConv1D",
]

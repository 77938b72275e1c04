"""The building blocks of `ipu_unit_scaling.functional`, for writing new unit-scaled ops."""
from __future__ import annotations

from ..ops import op_helpers as functional

__all__ = ["functional"]

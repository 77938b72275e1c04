"""unit-scaling's ``unit_scaling.core`` path: helpers for writing new unit-scaled ops."""
from __future__ import annotations

from . import functional

__all__ = ["functional"]

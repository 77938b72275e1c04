"""Constraints that tie forward and backward scales (unit-scaling's ``unit_scaling.constraints``
path; written in :mod:`ipu_unit_scaling.ops.scale_constraints`).
"""
from __future__ import annotations

from .ops.scale_constraints import *  # noqa: F403
from .ops.scale_constraints import __all__  # noqa: F401

"""The scaling primitive: separate forward and backward multipliers (unit-scaling's
``unit_scaling.scale`` path; written in :mod:`ipu_unit_scaling.ops.scaling_primitive`).
"""
from __future__ import annotations

from .ops.scaling_primitive import scale, scale_bwd, scale_fwd

__all__ = ["scale", "scale_fwd", "scale_bwd"]

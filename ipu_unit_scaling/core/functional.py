"""Helpers for writing unit-scaled ops (unit-scaling's ``unit_scaling.core.functional`` path;
written in `ipu_unit_scaling.ops.op_helpers`).
"""
from __future__ import annotations

from ..ops.op_helpers import *  # noqa: F403
from ..ops.op_helpers import __all__  # noqa: F401

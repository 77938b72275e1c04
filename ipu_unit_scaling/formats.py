"""Generic floating-point formats for simulating low precision (unit-scaling's
``unit_scaling.formats`` path; written in :mod:`ipu_unit_scaling.fp8.generic_formats`).
"""
from __future__ import annotations

from .fp8.generic_formats import *  # noqa: F403
from .fp8.generic_formats import __all__  # noqa: F401

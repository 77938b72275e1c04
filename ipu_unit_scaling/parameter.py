"""u-μP parameters that say what kind of tensor they are (unit-scaling's
``unit_scaling.parameter`` path; written in :mod:`ipu_unit_scaling.modules.mup_parameter`).
"""
from __future__ import annotations

from .modules.mup_parameter import *  # noqa: F403
from .modules.mup_parameter import __all__  # noqa: F401

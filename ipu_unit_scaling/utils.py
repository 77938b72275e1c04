"""``analyse_module`` (unit-scaling's ``unit_scaling.utils`` path; written in
:mod:`ipu_unit_scaling.analysis.module_analysis`).
"""
from __future__ import annotations

from .analysis.module_analysis import *  # noqa: F403
from .analysis.module_analysis import __all__  # noqa: F401

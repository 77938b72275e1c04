"""Optimizers that read each u-μP parameter's type (unit-scaling's ``unit_scaling.optim`` path;
written in :mod:`ipu_unit_scaling.parametrization.mup_optimizers`).
"""
from __future__ import annotations

from .parametrization.mup_optimizers import *  # noqa: F403
from .parametrization.mup_optimizers import __all__  # noqa: F401

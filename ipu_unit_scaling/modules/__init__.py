"""The modules layer: the unit-scaled ``torch.nn`` mirror (uu) and unit-scaling's u-μP blocks.

The package root re-exports these; this folder holds them."""
from __future__ import annotations

from .layers import *  # noqa: F401,F403
from .layers import __all__ as _layers_all

__all__ = list(_layers_all)

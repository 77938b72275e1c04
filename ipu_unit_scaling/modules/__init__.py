"""The modules layer: the unit-scaled ``torch.nn`` mirror (uu), the GPT blocks built from an ops
table, and unit-scaling's u-μP blocks.

The package root re-exports these; this folder holds them."""
from __future__ import annotations

from .gpt_blocks import *  # noqa: F401,F403
from .gpt_blocks import __all__ as _gpt_blocks_all
from .layers import *  # noqa: F401,F403
from .layers import __all__ as _layers_all

__all__ = [*_layers_all, *_gpt_blocks_all]

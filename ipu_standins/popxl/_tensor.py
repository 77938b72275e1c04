"""``popxl.tensor`` of the PopXL stand-in (popart: python/popxl/python_files/tensor.py).

PopXL keeps ``Variable`` and ``Constant`` here, not at its top level; so does the stand-in.
"""
from __future__ import annotations

from typing import List

from ._core import (
    Constant,
    Tensor,
    TensorLike,
    TensorSpec,
    Variable,
    constant,
    variable,
)

__all__ = ["Tensor", "Variable", "Constant", "TensorSpec", "TensorLike", "variable", "constant"]


def __dir__() -> List[str]:
    return sorted(__all__)

"""``popxl.tensor`` of the PopXL stand-in (popart: python/popxl/python_files/tensor.py).

PopXL keeps ``Variable`` and ``Constant`` here, not at its top level; so does the stand-in.
"""
from __future__ import annotations

from typing import List

from .reference import Tensor, TensorSpec, constant, variable
from .reference import _Constant as Constant
from .reference import _TensorLike as TensorLike
from .reference import _Variable as Variable

__all__ = ["Tensor", "Variable", "Constant", "TensorSpec", "TensorLike", "variable", "constant"]


def __dir__() -> List[str]:
    return sorted(__all__)

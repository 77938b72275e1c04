"""``poptorch.testing``."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["allclose"]


def allclose(ref: Any, other: Any) -> bool:
    """Whether ``other`` has ``ref``'s structure (tensors, tuples, lists) and close values."""
    if isinstance(ref, torch.Tensor):
        return torch.allclose(other, ref)
    if not isinstance(ref, (tuple, list)) or type(other) is not type(ref) or (
            len(ref) != len(other)):
        return False
    return all(allclose(r, o) for r, o in zip(ref, other))

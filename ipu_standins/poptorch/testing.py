"""``poptorch.testing``."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["allclose"]


def allclose(ref: Any, other: Any) -> bool:
    """Whether ``other`` has ``ref``'s structure (tensors, tuples, lists) and close values:
    ``torch.allclose(other, ref)``, so the relative tolerance scales with ``ref``."""
    if isinstance(ref, torch.Tensor):
        return torch.allclose(other, ref)
    if not isinstance(ref, (tuple, list)):
        raise TypeError(f"{type(ref).__name__} not supported: allclose compares tensors, "
                        "tuples and lists")
    # isinstance, as PopTorch's: a named tuple matches a tuple.
    kind = tuple if isinstance(ref, tuple) else list
    if not isinstance(other, kind) or len(ref) != len(other):
        return False
    return all(allclose(r, o) for r, o in zip(ref, other))

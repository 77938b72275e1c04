"""`torch_map`: torch's function -> the unit-scaled op of the same name (unit-scaling's
``unit_scaling.functional.torch_map``).

A graph transform that finds ``F.gelu`` or ``torch.matmul`` in a captured graph looks up the
op to call instead here. A name torch has in both ``torch`` and ``torch.nn.functional``
(``dropout``, ``softmax``) maps ``torch.nn.functional``'s function, as unit-scaling's map does.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F

from . import activation_ops, attention_ops, llm_ops, loss_ops, unit_ops

__all__ = ["torch_map"]


def _torch_counterparts() -> Dict[Callable[..., Any], Callable[..., Any]]:
    found: Dict[Callable[..., Any], Callable[..., Any]] = {}
    for module in (unit_ops, activation_ops, attention_ops, loss_ops, llm_ops):
        for name in module.__all__:
            torch_function = getattr(F, name, None) or getattr(torch, name, None)
            if callable(torch_function):
                found[torch_function] = getattr(module, name)
    return found


torch_map = _torch_counterparts()

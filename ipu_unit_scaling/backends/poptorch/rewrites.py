"""Exact rewrites of calls that PopTorch's handlers refuse, made before PopTorch sees them.

The IPU backends trace the model inside :class:`PopTorchRewrites` (as well as inside
:func:`ipu_unit_scaling.ipu.ipu_tracing`), and the emulator does the same, so both see the graph
that reaches PopTorch. Each rewrite computes the same values and gradients as the call it
replaces:

- ``F.layer_norm`` with a weight but no bias (the models' bias-free norms): PopTorch's layer
  norm handler takes both or neither (``popart_canonicalization/NormalizationOps.cpp``), so a
  zero bias built from Python values is passed; it is a compile-time constant, not a
  parameter, and adding zero changes no value.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PopTorchRewrites"]


def _layer_norm_arguments(args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    named = dict(zip(names, args))
    named.update(kwargs)
    return named


class PopTorchRewrites(TorchFunctionMode):
    """Inside, the calls listed in the module docstring take their PopTorch-compatible form."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.layer_norm:
            named = _layer_norm_arguments(args, kwargs)
            weight = named.get("weight")
            if weight is not None and named.get("bias") is None:
                named["bias"] = torch.zeros(tuple(named["normalized_shape"]),
                                            dtype=weight.dtype, device=weight.device)
                return func(**named)
        return func(*args, **kwargs)

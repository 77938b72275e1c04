"""Model-to-model transforms.

- `unit_scale(model)` converts an existing model to unit scaling (traced with torch.fx; see
  `unit_scale`);
- unit_scaling's composable graph transforms, captured by TorchDynamo (see `compose`):
  `simulate_format` / `simulate_fp8(module)` (low-precision casts around matmuls, on a copy),
  `track_scales` (tensor metrics on the captured graph, with the `prune_*` helpers) and
  `compile`;
- `simulate_fp8(model, FP8Config(...))`: this package's FP8 linear layers (per-tensor scaling
  biases under FP8-AMAX) put in place of the model's own, in place.
"""
from __future__ import annotations

from .compose import apply_transform, compile
from .quantise import simulate_format, simulate_fp8
from .replacements import UnitAttention, UnitConv1D, UnitMultiheadAttention
from .scale_tracking import (
    Metrics,
    prune_non_float_tensors,
    prune_same_scale_tensors,
    prune_selected_nodes,
    track_scales,
)
from .unit_scale import UnitScaleReport, UnitScaleWarning, unit_scale, unit_scale_with_report

__all__ = [
    "unit_scale",
    "unit_scale_with_report",
    "UnitScaleReport",
    "UnitScaleWarning",
    "UnitMultiheadAttention",
    "UnitAttention",
    "UnitConv1D",
    "apply_transform",
    "compile",
    "simulate_format",
    "simulate_fp8",
    "track_scales",
    "Metrics",
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
]

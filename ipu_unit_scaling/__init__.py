"""ipu-unit-scaling: unit scaling and FP8-AMAX for PyTorch, IPU-first.

`import ipu_unit_scaling as uu` gives the unit-scaled modules (mirroring `torch.nn`);
`import ipu_unit_scaling.functional as U` gives the unit-scaled ops (mirroring
`torch.nn.functional`).
"""
from __future__ import annotations

from . import constraints, functional
from .modules import (
    GELU,
    MHSA,
    MLP,
    TORCH_OPS,
    UNIT_OPS,
    AttentionProjection,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    GatedMLP,
    LayerNorm,
    Linear,
    Ops,
    ReLU,
    RMSNorm,
    SiLU,
    Softmax,
    TransformerDecoder,
    TransformerLayer,
)
from .scale import scale, scale_bwd, scale_fwd

__version__ = "0.1.0"

__all__ = [
    "functional",
    "constraints",
    "scale",
    "scale_fwd",
    "scale_bwd",
    "Linear",
    "AttentionProjection",
    "LayerNorm",
    "Embedding",
    "GELU",
    "ReLU",
    "Softmax",
    "Dropout",
    "CrossEntropyLoss",
    "RMSNorm",
    "SiLU",
    "GatedMLP",
    "MHSA",
    "MLP",
    "TransformerLayer",
    "TransformerDecoder",
    "Ops",
    "UNIT_OPS",
    "TORCH_OPS",
]

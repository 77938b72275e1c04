"""ipu-unit-scaling: unit scaling and FP8-AMAX for PyTorch, IPU-first.

`import ipu_unit_scaling as uu` gives the unit-scaled modules (mirroring `torch.nn`);
`import ipu_unit_scaling.functional as U` gives the unit-scaled ops (mirroring
`torch.nn.functional`). The public API of Graphcore Research's unit-scaling library (0.3.5) is a
subset of this one: code written for it runs with only its import changed.
"""
from __future__ import annotations

from . import _moved  # noqa: F401  (keeps the old import paths of moved modules working)

# isort: split
from . import core
from .fp8 import generic_formats as formats
from .modules import mup_parameter as parameter
from .modules.depth_blocks import (
    MHSA,
    MLP,
    DepthModuleList,
    DepthSequential,
    TransformerDecoder,
    TransformerLayer,
    TransformerStack,
)
from .modules.layers import (
    GELU,
    GPT,
    TORCH_OPS,
    UNIT_OPS,
    AttentionProjection,
    Conv1d,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    FeedForward,
    GatedMLP,
    LayerNorm,
    Linear,
    LinearReadout,
    Ops,
    ReLU,
    RMSNorm,
    SelfAttention,
    SiLU,
    Softmax,
    TransformerBlock,
    unit_attention,
)
from .modules.mup_parameter import MupType, Parameter
from .ops import scale_constraints as constraints
from .ops import unit_ops as functional
from .ops.op_helpers import transformer_residual_scaling_rule
from .ops.scaling_primitive import scale, scale_bwd, scale_fwd
from .parametrization import mup_optimizers as optim

__version__ = "0.1.0"

__all__ = [
    # submodules
    "functional",
    "constraints",
    "core",
    "formats",
    "optim",
    "parameter",
    # scaling primitives and u-μP parameters
    "scale",
    "scale_fwd",
    "scale_bwd",
    "Parameter",
    "MupType",
    "transformer_residual_scaling_rule",
    # leaf modules
    "Linear",
    "LinearReadout",
    "Conv1d",
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
    # unit_scaling's u-μP blocks
    "MHSA",
    "MLP",
    "TransformerLayer",
    "TransformerStack",
    "TransformerDecoder",
    "DepthModuleList",
    "DepthSequential",
    # this package's GPT blocks, built from an Ops table
    "SelfAttention",
    "FeedForward",
    "GatedMLP",
    "TransformerBlock",
    "GPT",
    "Ops",
    "UNIT_OPS",
    "TORCH_OPS",
    "unit_attention",
]

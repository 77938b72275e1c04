"""The ops layer: the scaling primitive, its constraints, the unit-scaled ops and their fused
eager forms, and the one switch to their PopTorch forms.

This package's namespace is ``U``: the unit-scaled counterparts of ``torch.nn.functional``,
which ``ipu_unit_scaling.functional`` re-exports. The ops are written in
:mod:`~ipu_unit_scaling.ops.unit_ops` (linear, matmul, normalisation, lookups, residuals),
:mod:`~ipu_unit_scaling.ops.activation_ops` (gelu, relu, softmax, dropout),
:mod:`~ipu_unit_scaling.ops.attention_ops`, :mod:`~ipu_unit_scaling.ops.loss_ops` and
:mod:`~ipu_unit_scaling.ops.llm_ops` (RMSNorm, SiLU, SwiGLU).
Nothing here imports from a layer above.
"""
from __future__ import annotations

from .activation_ops import dropout, gelu, relu, softmax
from .attention_ops import (
    attention_query_key_grad_scale,
    attention_value_bias_grad_scale,
    scaled_dot_product_attention,
)
from .llm_ops import rms_norm, silu, silu_glu
from .loss_ops import cross_entropy, mse_loss
from .unit_ops import (
    add,
    conv1d,
    embedding,
    layer_norm,
    linear,
    linear_readout,
    linear_scales,
    matmul,
    residual_add,
    residual_apply,
    residual_split,
)

__all__ = [
    "linear",
    "linear_scales",
    "linear_readout",
    "conv1d",
    "matmul",
    "gelu",
    "relu",
    "softmax",
    "dropout",
    "layer_norm",
    "embedding",
    "add",
    "residual_split",
    "residual_add",
    "residual_apply",
    "scaled_dot_product_attention",
    "attention_value_bias_grad_scale",
    "attention_query_key_grad_scale",
    "cross_entropy",
    "mse_loss",
    "rms_norm",
    "silu",
    "silu_glu",
]

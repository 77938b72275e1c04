"""The ops layer: the scaling primitive, its constraints, the unit-scaled ops and their fused
eager forms, and the one switch to their PopTorch forms.

This package's namespace is ``U``: the unit-scaled counterparts of ``torch.nn.functional``,
which ``ipu_unit_scaling.functional`` re-exports. The ops are written in
:mod:`~ipu_unit_scaling.ops.unit_ops` (linear, matmul, activations, normalisation, residuals,
attention, losses) and :mod:`~ipu_unit_scaling.ops.llm_ops` (RMSNorm, SiLU, SwiGLU).
Nothing here imports from a layer above.
"""
from __future__ import annotations

from .llm_ops import rms_norm, silu, silu_glu
from .unit_ops import (
    add,
    attention_query_key_grad_scale,
    attention_value_bias_grad_scale,
    conv1d,
    cross_entropy,
    dropout,
    embedding,
    gelu,
    layer_norm,
    linear,
    linear_readout,
    linear_scales,
    matmul,
    mse_loss,
    relu,
    residual_add,
    residual_apply,
    residual_split,
    scaled_dot_product_attention,
    softmax,
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

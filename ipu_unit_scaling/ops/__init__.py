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

from . import activation_ops, attention_ops, llm_ops, loss_ops, unit_ops
from .activation_ops import *  # noqa: F403
from .attention_ops import *  # noqa: F403
from .llm_ops import *  # noqa: F403
from .loss_ops import *  # noqa: F403
from .unit_ops import *  # noqa: F403

__all__ = [*unit_ops.__all__, *activation_ops.__all__, *attention_ops.__all__,
           *loss_ops.__all__, *llm_ops.__all__]

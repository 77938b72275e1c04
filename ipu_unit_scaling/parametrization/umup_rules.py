"""Three u-μP rules that come in two forms: the hidden linears' constraint, attention's output
scale and the GELU's constraint. ``docs/results/umup-rules/`` has the side-by-sides that chose
each default: attention and the GELU follow the u-μP paper and the published ``unit-scaling``
library; the hidden linears keep unit scaling's geometric mean, which measured better than the
library's rule.

- **Hidden linears** (every linear in the residual blocks):

  - ``"gmean"`` (default): both passes take ``(fan_in * fan_out) ** -1/4``, the geometric mean
    of unit scaling's forward ``1/sqrt(fan_in)`` and backward ``1/sqrt(fan_out)``
    (:data:`ipu_unit_scaling.modules.UNIT_OPS`'s constraint). The forward multiplier then
    differs from the paper's hidden ``1/sqrt(fan_in)`` by ``(fan_in / fan_out) ** 1/4``: 0.76
    for the fused query-key-value projection, 0.71 for the MLP's up-projection and 1.41 for
    its down-projection at expansion 4, 1 for square weights.
  - ``"to_output_scale"``: ``1/sqrt(fan_in)`` in both passes, the paper's forward multiplier
    and the library's ``Linear`` default (which its attention projections use; its SwiGLU MLP
    leaves the backward at ``1/sqrt(fan_out)``). One scale in both passes: the gradient
    reaching the residual stream is the true gradient of the scaled forward pass.

- **Attention's output** (q, k, v unit, logits ``scale * q.k``, logit std ``s = scale *
  sqrt(head_dim)``) is a p-weighted mean of values, below unit variance:

  - ``"constant"`` (default): one factor for every query row, the library's empirical model,
    ``sqrt(1 - dropout_p) / lower ** (1 - alpha)`` with ``alpha = s**2 / (s**2 + 4)`` (the
    library's ``1 / (1 + 4 head_dim / mult**2)``) and ``lower = sqrt(log(L) / L)`` for causal
    attention over ``L`` keys, ``sqrt(1 / L)`` otherwise (one key: 1, the value itself). It
    interpolates in log space between uniform attention (``alpha = 0``, small logits) and
    one-hot attention (``alpha = 1``, factor 1). About 5.07 for causal attention over 128 keys
    of head size 32 at u-μP's ``1/head_dim`` logits. Unit on average over the rows, not row by
    row: causal attention's first rows, which see few keys, come out larger than unit.
  - ``"per-row"``: row ``i`` of ``m`` visible keys gets ``sqrt((1 - dropout_p) / E[sum p**2])``
    (:func:`ipu_unit_scaling.functional.scaled_dot_product_attention`): every row unit, so
    causal attention's first rows get far smaller factors than its last (1 at the first row).

Both forms scale the output in the forward pass and q, k and v's gradients by the same
factor, as the library does.

- **The MLP's GELU** (:class:`~ipu_unit_scaling.parametrization.umup.ScaledGELU`, output scale
  ``1/std(gelu(mult z))`` and input-gradient scale ``1/rms(d/dz gelu(mult z))`` for z ~ N(0,
  1), tied):

  - ``"to_output_scale"`` (default): the output scale in both passes, the library's ``gelu``
    default (1.70 at ``ffn_act_mult`` 1, where the exact gradient scale is 1.48).
  - ``"gmean"``: their geometric mean in both passes (1.59 at ``ffn_act_mult`` 1), unit
    scaling's tie. The two measured equal (``docs/results/umup-rules/gelu.md``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from ..modules.gpt_blocks import unit_attention
from ..modules.layers import Linear
from ..ops import attention_ops
from ..ops.trace_switch import is_ipu_tracing

__all__ = [
    "HIDDEN_CONSTRAINTS",
    "ATTENTION_SCALINGS",
    "GELU_CONSTRAINTS",
    "UmupRules",
    "constant_attention_scale",
    "constant_scale_attention",
    "hidden_linear",
    "attention_op",
]

HIDDEN_CONSTRAINTS = ("gmean", "to_output_scale")
ATTENTION_SCALINGS = ("constant", "per-row")
GELU_CONSTRAINTS = ("to_output_scale", "gmean")


@dataclass(frozen=True)
class UmupRules:
    """Which form of each rule a u-μP model uses (see the module docstring)."""

    hidden_constraint: str = "gmean"
    attention_scaling: str = "constant"
    gelu_constraint: str = "to_output_scale"

    def __post_init__(self) -> None:
        if self.hidden_constraint not in HIDDEN_CONSTRAINTS:
            raise ValueError(f"hidden_constraint {self.hidden_constraint!r} is not one of "
                             f"{', '.join(HIDDEN_CONSTRAINTS)}")
        if self.attention_scaling not in ATTENTION_SCALINGS:
            raise ValueError(f"attention_scaling {self.attention_scaling!r} is not one of "
                             f"{', '.join(ATTENTION_SCALINGS)}")
        if self.gelu_constraint not in GELU_CONSTRAINTS:
            raise ValueError(f"gelu_constraint {self.gelu_constraint!r} is not one of "
                             f"{', '.join(GELU_CONSTRAINTS)}")


def constant_attention_scale(key_len: int, logit_std: float, is_causal: bool,
                             dropout_p: float = 0.0) -> float:
    """The ``"constant"`` rule's factor (module docstring): ``sqrt(1 - dropout_p) /
    lower ** (1 - alpha)``."""
    if key_len < 1:
        raise ValueError(f"key_len={key_len} must be at least 1")
    alpha = logit_std**2 / (logit_std**2 + 4)
    if key_len == 1:
        lower = 1.0
    else:
        lower = math.sqrt((math.log(key_len) if is_causal else 1.0) / key_len)
    return math.sqrt(1 - dropout_p) / lower ** (1 - alpha)


def constant_scale_attention(query: Tensor, key: Tensor, value: Tensor,
                             attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                             is_causal: bool = False, scale: Optional[float] = None,
                             enable_gqa: bool = False) -> Tensor:
    """Attention with the ``"constant"`` output factor, torch's signature; ``scale`` defaults to
    u-μP's ``1/head_dim``. A boolean ``attn_mask`` gets the non-causal factor (a mask does not
    say whether it is causal). Under ``ipu_tracing()`` it is built from ops PopTorch has."""
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot both be given")
    head_dim = query.shape[-1]
    if scale is None:
        scale = 1 / max(1, head_dim)
    if enable_gqa:
        key = attention_ops.repeat_kv_heads(query, key)
        value = attention_ops.repeat_kv_heads(query, value)
    logit_std = scale * math.sqrt(head_dim)
    if abs(logit_std - 1.0) >= 1e-12:
        # torch 2.0 has no `scale` argument: fold it into the query.
        query = query * logit_std
    if is_ipu_tracing():
        out = attention_ops.explicit_attention(query, key, value, attn_mask, dropout_p, is_causal)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                             dropout_p=dropout_p, is_causal=is_causal)
    return out * constant_attention_scale(key.shape[-2], logit_std, is_causal, dropout_p)


def hidden_linear(rules: UmupRules) -> Callable[..., nn.Module]:
    """``Ops.Linear`` for the blocks' linears under ``rules``."""
    return functools.partial(Linear, constraint=rules.hidden_constraint)


def attention_op(rules: UmupRules) -> Callable[..., Tensor]:
    """``Ops.scaled_dot_product_attention`` under ``rules``."""
    return constant_scale_attention if rules.attention_scaling == "constant" else unit_attention

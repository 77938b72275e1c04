"""Ops that PopTorch receives in another form than the host's torch computes them.

- ``F.scaled_dot_product_attention``: PopTorch's torch (2.0.1) has no fused attention kernel
  for the IPU, so the op reaches its dispatcher as torch's math form: the logits
  ``(q * c) @ (k * c)^T`` with ``c`` the square root of the logits' scale (``1 /
  sqrt(head size)`` unless ``scale`` is given), a boolean mask (``is_causal``'s lower
  triangle too) turned into an additive one of zeros and ``-inf``, the softmax over the keys,
  dropout, and the matmul with the values. The host's torch would pick its CPU flash kernel,
  one op PopTorch has no handler for; :func:`math_attention` computes the math form, with ops
  the trace sees one by one. ``enable_gqa`` (torch 2.5) repeats each key and value head for
  its group of query heads.
- ``F.one_hot`` and ``torch.bincount``, which PopTorch's dispatcher takes whole, computed as
  its handlers compute them, with ops of fixed shapes (:func:`one_hot_without_checks`,
  :func:`static_bincount`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["math_attention", "one_hot_without_checks", "static_bincount"]


def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: Optional[float] = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` in torch's math form (module doc); its arguments."""
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                           "when is_causal=True")
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    logit_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    side = math.sqrt(logit_scale)
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                               device=query.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            attn_mask.logical_not(), -math.inf)
    logits = torch.matmul(query * side, key.transpose(-2, -1) * side)
    if attn_mask is not None:
        logits = logits + attn_mask
    weights = torch.softmax(logits, dim=-1)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, dropout_p, training=True)
    return torch.matmul(weights, value)


def one_hot_without_checks(indices: torch.Tensor, num_classes: int = -1) -> torch.Tensor:
    """``F.one_hot`` without torch's range checks, which read the indices on the host."""
    classes = torch.arange(num_classes, dtype=indices.dtype, device=indices.device)
    return (indices.unsqueeze(-1) == classes).to(torch.long)


def static_bincount(input: torch.Tensor, weights: Optional[torch.Tensor] = None,
                     minlength: int = 0) -> torch.Tensor:
    """``torch.bincount`` as PopTorch's handler computes it (``OtherOps.cpp``): ``minlength``
    bins; a value of ``minlength`` or more is counted at index ``len(input) - 1`` instead, and
    an index past the last bin is dropped by the scatter."""
    count = input.shape[0]
    index = torch.where(input < minlength, input.long(), torch.full_like(input.long(), count - 1))
    values = torch.ones(count, dtype=torch.long) if weights is None else weights
    inside = index < minlength
    out = torch.zeros(minlength, dtype=values.dtype)
    return out.index_add(0, torch.where(inside, index, torch.zeros_like(index)),
                         torch.where(inside, values, torch.zeros_like(values)))

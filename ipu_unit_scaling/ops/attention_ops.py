"""Unit-scaled attention: ``scaled_dot_product_attention`` and the scales of its gradients
(per-row output scales for causal and masked attention)."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_ops as fused
from . import rule_switch
from .activation_ops import expected_softmax_square_sum, positive_mult
from .softmax_moments import query_key_gradient_variance
from .trace_switch import is_ipu_tracing

__all__ = [
    "scaled_dot_product_attention",
    "attention_value_bias_grad_scale",
    "attention_query_key_grad_scale",
]


# ---------------------------------------------------------------- attention


def _visible_keys(
    query_len: int, key_len: int, attn_mask: Optional[Tensor], is_causal: bool,
    device: torch.device, dtype: torch.dtype = torch.float32,
) -> Union[float, Tensor]:
    """How many keys each query row attends to (at least 1): a float, or a (..., rows, 1) tensor
    of `dtype` widened to float32 at least (a float64 model's row scales are float64 end to end;
    16-bit models' are computed in float32 and rounded once)."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(
                "attn_mask must be a boolean mask for the unit-scaled attention: an additive "
                "float mask changes the softmax's scale by an amount it cannot know"
            )
        return attn_mask.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
    if is_causal:
        rows = torch.arange(1, query_len + 1, device=device, dtype=dtype)
        return rows.clamp(min=1, max=max(1, key_len)).unsqueeze(-1)
    return float(max(1, key_len))


def explicit_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
) -> Tensor:
    """`F.scaled_dot_product_attention` (default scale) from matmul, masking and softmax.

    PopTorch has no handler for the fused attention op; every op used here is on its list.
    """
    scores = torch.matmul(query, key.transpose(-2, -1)) * max(1, query.shape[-1]) ** -0.5
    if is_causal:
        hidden = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                            device=query.device).triu(diagonal=1)
        scores = scores.masked_fill(hidden, -math.inf)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(attn_mask.logical_not(), -math.inf)
    elif attn_mask is not None:
        scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, value)


def repeat_kv_heads(query: Tensor, key_or_value: Tensor) -> Tensor:
    """Key or value heads repeated G times in place (h -> h // G), for grouped-query attention."""
    if query.dim() < 3 or key_or_value.dim() < 3:
        raise ValueError("enable_gqa needs query, key and value with a heads dimension (-3)")
    heads, kv_heads = query.shape[-3], key_or_value.shape[-3]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"enable_gqa: {heads} query heads are not a multiple of {kv_heads} "
                         "key/value heads")
    groups = heads // kv_heads
    if groups == 1:
        return key_or_value
    *batch, _, length, width = key_or_value.shape
    expanded = key_or_value.unsqueeze(-3).expand(*batch, kv_heads, groups, length, width)
    return expanded.reshape(*batch, heads, length, width)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    mult: float = 1.0,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Unit-scaled `F.scaled_dot_product_attention` with u-μP's logits `mult * q.k / d`.

    The logits are scaled by `mult / head_dim` (μP's 1/d, with u-μP's `attn_softmax_mult`), as
    in unit_scaling; `scale` (torch's argument) replaces that factor, and `scale=head_dim**-0.5`
    gives torch's default. Give one of `mult` and `scale`.

    Rule: with unit q, k, v, the logits have std s = scale * sqrt(d) (mult / sqrt(d) by
    default, 1 at torch's scale) and a query row that sees m keys outputs a p-weighted mean of
    values with variance `S(m) = E[sum p**2]`, times 1/(1-p) with dropout. Each row is multiplied
    by `sqrt((1 - dropout_p) / S(m))` in both passes, which makes the output unit and, on average
    over key positions, the value gradient unit too. The query and key gradients come out at
    std s sqrt(C(m)), below s for few keys; `attention_query_key_grad_scale` says why and
    scales their projections' parameters, a cut edge. m comes from `is_causal` or a
    boolean `attn_mask`. Under `ipu_tracing()` the attention is built from matmuls, a mask and
    a softmax, which PopTorch supports, instead of the fused op.

    With `enable_gqa` (grouped-query attention), key and value have fewer heads, Hkv, each
    shared by G = Hq / Hkv query heads (query head h uses key/value head h // G, as in torch);
    they are repeated with expand and reshape, ops PopTorch has. The output and the query
    gradient stay unit. A key or value head's gradient sums over its G query heads: std
    sqrt(G). That is the true gradient and is kept: a backward-only `G**-0.5` would weigh the key
    and value paths against the query path in every gradient upstream of the projections
    (activations, not cut edges), and sqrt(G) (1.4 to 2.8 for G = 2 to 8) is far inside the
    gradient format's range.

    Under `rules("unit-scaling")`, unit-scaling 0.3.5's rule: one scale for every row (the
    output, and the query, key and value gradients), interpolated between the flat and one-hot
    limits, with `log(m) / m` for causal attention (`rule_switch.attention_scale`); any mask is
    then accepted, and the scale is that of unmasked attention.
    """
    if scale is None:
        # (unit-scaling divides by the values' head size)
        head_dim = value.shape[-1] if rule_switch.library_rules() else query.shape[-1]
        scale = positive_mult(mult) / max(1, head_dim)
    elif mult != 1.0:
        raise ValueError(f"mult={mult!r} and scale={scale!r}: give one of them, not both")
    if enable_gqa:
        key, value = repeat_kv_heads(query, key), repeat_kv_heads(query, value)
    if rule_switch.library_rules():
        out = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale)[0]
        return out * rule_switch.attention_scale(value.shape[-2], value.shape[-1],
                                                 scale * value.shape[-1], is_causal, dropout_p)
    out, row_scale = attention_before_row_scale(query, key, value, attn_mask, dropout_p,
                                                is_causal, scale)
    return out * row_scale


def attention_before_row_scale(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Union[float, Tensor]]:
    """`scaled_dot_product_attention` (key and value with the query's heads) as (the attention
    output, the row scale that makes it unit): a float, or a tensor broadcasting over the
    output's (..., rows, 1).

    For callers that can apply the row scale later, where it costs less (see `uu.SelfAttention`).
    """
    out, logit_std = _attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    if attn_mask is None and fused.eager_forms():
        row_scale = _cached_row_scale(query.shape[-2], key.shape[-2], is_causal, logit_std,
                                      dropout_p, out.dtype, out.device)
    else:
        row_scale = _row_scale(query.shape[-2], key.shape[-2], attn_mask, is_causal, logit_std,
                               dropout_p, out.dtype, out.device)
    return out, row_scale


def _attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
               dropout_p: float, is_causal: bool, scale: Optional[float]) -> Tuple[Tensor, float]:
    """(the unscaled attention output for logits `scale * q.k`, the logits' std for unit q
    and k), from the fused op or, under `ipu_tracing()`, ops PopTorch has."""
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot both be given")
    head_dim = query.shape[-1]
    logit_std = 1.0 if scale is None else scale * math.sqrt(head_dim)
    if abs(logit_std - 1.0) < 1e-12:
        logit_std = 1.0  # torch's default scale, given or not: the same kernel call
    else:
        # torch 2.0 has no `scale` argument: fold it into the query instead.
        query = query * logit_std
    if is_ipu_tracing():
        out = explicit_attention(query, key, value, attn_mask, dropout_p, is_causal)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    return out, logit_std


def _row_scale(query_len: int, key_len: int, attn_mask: Optional[Tensor], is_causal: bool,
               logit_std: float, dropout_p: float, dtype: torch.dtype,
               device: torch.device) -> Union[float, Tensor]:
    """sqrt((1 - dropout_p) / E[sum p**2]) for each query row: a float, or a (..., rows, 1)
    tensor."""
    visible = _visible_keys(query_len, key_len, attn_mask, is_causal, device, dtype)
    square_sum = expected_softmax_square_sum(visible, logit_std, max(1, key_len))
    row_scale = ((1 - dropout_p) / square_sum) ** 0.5
    return row_scale.to(dtype) if isinstance(row_scale, Tensor) else row_scale


_ROW_SCALES: Dict[tuple, Union[float, Tensor]] = {}


def _cached_row_scale(*key: Any) -> Union[float, Tensor]:
    """:func:`_row_scale` without a mask, computed once per shape: a dozen small ops saved at
    every eager call. Not under tracing or compilation, where it would be a captured constant."""
    row_scale = _ROW_SCALES.get(key)
    if row_scale is None:
        if len(_ROW_SCALES) >= 64:
            _ROW_SCALES.clear()
        row_scale = _ROW_SCALES[key] = _row_scale(key[0], key[1], None, *key[2:])
    return row_scale


@lru_cache(maxsize=256)
def attention_value_bias_grad_scale(
    key_len: int, dropout_p: float = 0.0, is_causal: bool = False, logit_std: float = 1.0
) -> float:
    """Extra gradient scale for a bias added to the values of `scaled_dot_product_attention`.

    Rule: each row of the attention matrix sums to 1, so a bias b added to every value comes
    out of attention unchanged, `attention(q, k, v + 1 b^T) = attention(q, k, v) + 1 b^T`, and
    then meets the row scale r_i = sqrt((1 - dropout_p) / S(m_i)) of query row i (see
    `scaled_dot_product_attention`). The bias's gradient is therefore sum_i r_i g_i: the
    gradient of a bias added after attention, sum_i g_i, with every row weighted by r_i (about
    3.6 for 32 keys). For independent unit g_i its variance is the rows' mean of `r_i**2` times
    theirs, so dividing by that root mean square makes it the gradient the linear's own
    `batch_size**-0.5` was chosen for. A bias's gradient scale is a cut edge: it changes only
    that parameter's update, nothing upstream of it.

    Returns `1 / sqrt(mean_i r_i**2)` for self-attention over `key_len` positions: every row
    sees all keys (m_i = key_len; a padding mask is taken as such), or with `is_causal` row i
    sees i keys. Dropout keeps a row's sum at 1 on average, so its (1 - p) stays in r_i.
    """
    keep = 1.0 - dropout_p
    n = max(1, int(key_len))
    if not is_causal:
        return (expected_softmax_square_sum(float(n), logit_std) / keep) ** 0.5
    inverse_sum = sum(1.0 / expected_softmax_square_sum(float(m), logit_std, n)
                      for m in range(1, n + 1))
    return (keep * inverse_sum / n) ** -0.5


@lru_cache(maxsize=256)
def attention_query_key_grad_scale(
    key_len: int, is_causal: bool = False, logit_std: float = 1.0
) -> float:
    """Extra gradient scale for the weight and bias of a linear whose output is only the
    queries, or only the keys, of `scaled_dot_product_attention`.

    Rule: for a query row that sees m keys, with independent unit q, k, v and output gradient,
    the query gradient's variance per element is `s**2 C(m)`, s the logits' std, with
    `C(m) = 1 - (2 E[sum p**3] - E[(sum p**2)**2]) / E[sum p**2]`. It comes from
    `dq = s / sqrt(d) sum_j p_j (a_j - sum_l p_l a_l) k_j`, a_j the output gradient's product
    with value j times the row scale: the gradient reaching the logits is centred under p and
    so sees `k_j - sum_l p_l k_l`, and the row scale `1 / sqrt(E[sum p**2])` cancels
    `E[sum p**2]` except for the centring. The key gradient is the same, summed over the rows
    that see it. C is 0.23 for 2 keys, 0.58 for 8, 0.81 for 32 and 0.93 for 128; dropout
    leaves it unchanged (its 1 / (1 - p) meets the row scale's 1 - p), and terms of order
    1 / head_dim are left out. `_softmax_moments` computes the moments by quadrature.

    A projection's weight gradient sums its rows' gradients, so its variance is the rows'
    mean of `s**2 C(m_i)`; this returns `1 / (s * sqrt(mean_i C(m_i)))`, rows seeing all
    `key_len` keys or, with `is_causal`, row i the first i. Scaling a parameter's gradient
    is a cut edge: the gradients of the activations, and every other parameter, are unchanged.
    Where no row sees two keys the gradient is exactly zero, and the scale is 1.
    """
    n = max(1, int(key_len))
    variance = query_key_gradient_variance(n, logit_std)
    mean_variance = float(variance.mean()) if is_causal else float(variance[-1])
    if mean_variance <= 0.0 or logit_std == 0.0:
        return 1.0
    return 1.0 / (abs(logit_std) * math.sqrt(mean_variance))

"""FP8 for attention's two matmuls (scores = q k^T, output = p v).

:func:`fp8_attention` is a context manager: inside it, calls to
``F.scaled_dot_product_attention`` run an explicit softmax attention whose two matmuls go
through :func:`fp8_matmul`, and explicit matmuls (``@``, ``torch.matmul``, ``torch.bmm``) are
FP8 matmuls too. It is meant to wrap an attention function only (that is what
:func:`ipu_unit_scaling.transforms.simulate_fp8` does for a module's ``attention_fn`` or
``attention``), not a whole model: the matmuls inside FP8 linear layers would otherwise be cast
twice.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .fp8_config import FP8Config
from .linear import fp8_matmul

__all__ = ["fp8_scaled_dot_product_attention", "fp8_attention", "FP8AttentionFn"]

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
            torch.Tensor.bmm)


def fp8_scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    config: Optional[FP8Config] = None,
    site: str = "attention",
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` semantics, with FP8 casts around both matmuls.

    The softmax, masking and dropout run in the input precision.
    """
    if enable_gqa:
        raise ValueError("fp8_scaled_dot_product_attention does not support enable_gqa")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = fp8_matmul(query, key.transpose(-2, -1), config, f"{site}.scores") * scale
    if is_causal:
        length, source = query.shape[-2], key.shape[-2]
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return fp8_matmul(probs, value, config, f"{site}.values")


class fp8_attention(TorchFunctionMode):  # noqa: N801 - used like a function: `with fp8_attention():`
    """Context manager making attention's matmuls FP8 (see the module docstring)."""

    def __init__(self, config: Optional[FP8Config] = None, site: str = "attention") -> None:
        super().__init__()
        self.config = config
        self.site = site

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return fp8_scaled_dot_product_attention(*args, config=self.config, site=self.site,
                                                    **kwargs)
        if func in _MATMULS and not kwargs and len(args) == 2:
            a, b = args
            if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    and a.is_floating_point() and a.dim() >= 2 and b.dim() >= 2):
                return fp8_matmul(a, b, self.config, f"{self.site}.matmul")
        return func(*args, **kwargs)


class FP8AttentionFn:
    """Wraps an attention function so that it runs inside :func:`fp8_attention`."""

    def __init__(self, fn: Callable[..., torch.Tensor], config: FP8Config, site: str) -> None:
        self.fn = fn
        self.config = config
        self.site = site

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with fp8_attention(self.config, self.site):
            return self.fn(*args, **kwargs)

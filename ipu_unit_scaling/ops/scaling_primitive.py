"""The one primitive of unit scaling: separate forward and backward multipliers.

Unit scaling gives an op different scales in its forward and backward passes. Everything in
`ipu_unit_scaling.functional` is built from `scale`, `scale_fwd` and `scale_bwd`.

Two forms, chosen by :func:`ipu_unit_scaling.ops.trace_switch.is_ipu_tracing`:

- eager: a custom autograd Function, one multiply each way;
- traced (PopTorch): one ``ScaledIdentity`` op (:mod:`ipu_unit_scaling.ops.scaled_identity`), whose
  value is ``x * f`` and whose gradient op multiplies by ``b``, so PopART's autodiff reproduces
  the backward scale. The backward multiplier never touches the forward values, so a large
  ``b`` (a loss's grad scale) cannot overflow them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Tuple

import torch
from torch import Tensor

from .scaled_identity import scaled_identity, traced_scale
from .trace_switch import is_ipu_tracing


def _never() -> bool:
    return False


_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _never)
_one_op: List[bool] = []


@contextlib.contextmanager
def scales_as_one_op() -> Iterator[None]:
    """Inside it, a scale that TorchDynamo captures is the one ``scaled_identity`` op instead of
    the autograd Function: for graphs that run eagerly after capture (the graph transforms
    without TorchInductor), where a captured Function would run as a higher-order op whose
    forward and backward graphs are interpreted node by node at every call."""
    _one_op.append(True)
    try:
        yield
    finally:
        _one_op.pop()


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
        ctx.bwd_scale = bwd_scale
        return x * fwd_scale if fwd_scale != 1.0 else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        bwd_scale = ctx.bwd_scale
        return (grad * bwd_scale if bwd_scale != 1.0 else grad), None, None


def scale(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
    """Multiply `x` by `fwd_scale` in the forward pass and its gradient by `bwd_scale`."""
    fwd_scale, bwd_scale = float(fwd_scale), float(bwd_scale)
    if fwd_scale == bwd_scale:
        # A plain multiply has the same semantics and lets autograd and torch.compile fuse it.
        return x * fwd_scale if fwd_scale != 1.0 else x
    if is_ipu_tracing():
        return traced_scale(x, fwd_scale, bwd_scale)
    if _one_op and _compiling():
        return scaled_identity(x, fwd_scale, bwd_scale)
    return _Scale.apply(x, fwd_scale, bwd_scale)


def scale_fwd(x: Tensor, s: float) -> Tensor:
    """Multiply by `s` in the forward pass; the gradient passes through unchanged."""
    return scale(x, s, 1.0)


def scale_bwd(x: Tensor, s: float) -> Tensor:
    """Identity in the forward pass; the gradient is multiplied by `s`."""
    return scale(x, 1.0, s)

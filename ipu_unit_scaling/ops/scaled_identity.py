"""``scale(x, f, b)`` as one graph op under :func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing`.

PopTorch traces only the forward pass and lets PopART differentiate it, so a scale whose
backward multiplier differs from its forward one must carry its gradient in the graph. One op
does that: ``ScaledIdentity``, forward ``y = f * x``, gradient ``dx = b * dy``. It has two
implementations with the same numerics:

- on the IPU, the PopART op of ``custom_ops/scaled_identity.cpp`` with its grad op, called
  through ``poptorch.custom_op`` by the IPU backend's custom-op implementation
  (:class:`ipu_unit_scaling.backends.poptorch.fp8_custom_op.PopTorchFP8CustomOps`);
- everywhere else, the ``torch.library`` op ``ipu_unit_scaling::scaled_identity(x, fwd_scale,
  bwd_scale)`` registered here: on the CPU, in the emulator (one node of the traced graph, whose
  gradient autograd takes from this op's Autograd kernel, as PopART takes it from the grad op),
  and under ``make_fx``.

The value is ``x * fwd_scale``, the same multiply as the eager form's, so the traced and eager
forms give the same bits. Both scales reach the IPU as float32 attributes; for float16 inputs
the product is computed in float32 and rounded once to float16, as torch's CPU kernel does.

The composite form ``x.detach() * f + (x - x.detach()) * b`` (six graph ops) is kept for a
custom-op implementation without this op (the IPU backend when ``custom_ops/`` is not built)
and for comparison (:func:`composite_scales`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Protocol, Tuple, runtime_checkable

import torch
from torch import Tensor

from . import trace_switch as tracing
from .op_library import LIBRARY, below_autograd

__all__ = ["ScaledIdentityOp", "scaled_identity", "composite_scale", "traced_scale",
           "composite_scales"]

LIBRARY.define("scaled_identity(Tensor x, float fwd_scale, float bwd_scale) -> Tensor")


def _kernel(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
    # A new tensor even for fwd_scale == 1: an op's output must not alias its input.
    return x * fwd_scale


class _ScaledIdentity(torch.autograd.Function):
    """The op's Autograd kernel: what PopART's ScaledIdentityGrad computes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
        ctx.bwd_scale = bwd_scale
        with below_autograd():
            return torch.ops.ipu_unit_scaling.scaled_identity(x, fwd_scale, bwd_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None, None]:
        return grad * ctx.bwd_scale, None, None


def _autograd_kernel(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
    return _ScaledIdentity.apply(x, fwd_scale, bwd_scale)


# Every backend, Meta (fake-tensor tracing) included, runs the one multiply.
LIBRARY.impl("scaled_identity", _kernel, "CompositeExplicitAutograd")
LIBRARY.impl("scaled_identity", _autograd_kernel, "Autograd")


def scaled_identity(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
    """``x * fwd_scale``, whose gradient is ``bwd_scale`` times the output's: one op."""
    return torch.ops.ipu_unit_scaling.scaled_identity(x, float(fwd_scale), float(bwd_scale))


@runtime_checkable
class ScaledIdentityOp(Protocol):
    """A custom-op implementation (see :func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing`) that
    also
    implements ScaledIdentity."""

    def scaled_identity(self, x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
        """``x * fwd_scale`` whose gradient is ``bwd_scale`` times the output's."""
        ...


def composite_scale(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
    """``x.detach() * f + (x - x.detach()) * b``: value ``x * f`` (for finite x), gradient
    ``b``, from differentiable forward ops alone."""
    detached = x.detach()
    value = detached * fwd_scale if fwd_scale != 1.0 else detached
    gradient_path = x - detached
    if bwd_scale != 1.0:
        gradient_path = gradient_path * bwd_scale
    return value + gradient_path


_composite: List[bool] = []


@contextlib.contextmanager
def composite_scales() -> Iterator[None]:
    """Inside it, traced scales take the composite form: the graph an IPU gets when the
    custom-op library is not built."""
    _composite.append(True)
    try:
        yield
    finally:
        _composite.pop()


def traced_scale(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
    """:func:`ipu_unit_scaling.scale` under ``ipu_tracing()`` (``fwd_scale != bwd_scale``).

    The custom-op implementation given to ``ipu_tracing`` makes the op if it can (on the IPU:
    ``poptorch.custom_op``); without one, the ``torch.library`` op; with one that has no
    ScaledIdentity, or inside :func:`composite_scales`, the composite form.
    """
    if _composite:
        return composite_scale(x, fwd_scale, bwd_scale)
    custom_ops = tracing.fp8_custom_ops()
    if custom_ops is None:
        return scaled_identity(x, fwd_scale, bwd_scale)
    if isinstance(custom_ops, ScaledIdentityOp):
        return custom_ops.scaled_identity(x, fwd_scale, bwd_scale)
    return composite_scale(x, fwd_scale, bwd_scale)

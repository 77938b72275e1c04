"""The grouped FP8 casts as graph ops that carry their gradients: what the rowwise, block and
MX recipes' FP8 linear is traced from for PopTorch.

Two ops, the grouped counterparts of :mod:`~ipu_unit_scaling.fp8.cast_ops`' two, each cast
with one scale per group of a 2-D tensor along its last dimension (``grouping`` "row",
"tile" or "block", see :class:`~.group_cast.Grouping`; formats F143, F152, E4M3FN, E5M2;
rules "amax" and "mx"):

``ipu_unit_scaling::fp8_group_quantise(x, format, grouping, group_size, rule, scale_rounding,
margin, saturate)``
    The values ``decode(cast(x * 2**s)) * 2**-s`` with each group's ``s``, the scales and the
    non-finite flags (:mod:`~.codelet_blocks`, the ``Fp8GroupQuantise`` PopART op). Gradient:
    straight through.

``ipu_unit_scaling::fp8_group_quantise_gradient(x, <the same attributes>)``
    The identity (a new tensor). Gradient: the values of ``fp8_group_quantise(dy, ...)``. On
    the IPU it is the ``Fp8GroupGradientQuantise`` PopART op, whose grad op runs the same
    codelets on the gradient (``custom_ops/fp8_group_quantise.cpp``).

:func:`grouped_quantise` and :func:`grouped_quantise_gradient` choose between the two forms as
:func:`~.cast_ops.fp8_quantise` does: inside
:func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing` with an implementation that has these
ops (a :class:`~ipu_unit_scaling.ops.trace_switch.GroupQuantiseOps`: the IPU backend's,
through ``poptorch.custom_op``), that implementation; otherwise the ``torch.library`` ops,
which the PopTorch stand-in takes as the custom ops. As on the IPU, a group whose amax is
not finite gets ``s = 0`` instead of an error where the host library is built.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ..ops import trace_switch as tracing
from ..ops.op_library import LIBRARY
from ..ops.op_library import below_autograd as _below_autograd
from .codelet_blocks import ELEMENT_GRIDS, group_scale_shape
from .group_cast import Grouping
from .scaling import check_margin

__all__ = ["GROUP_GRADIENT_QUANTISE_OP", "group_quantise_attributes", "check_group_cast",
           "grouped_quantise", "grouped_quantise_gradient"]

# The PopART op (domain ai.graphcore.unit_scaling), beside codelet_blocks.GROUP_QUANTISE_OP.
GROUP_GRADIENT_QUANTISE_OP = "Fp8GroupGradientQuantise"
_DTYPES = (torch.float32, torch.float16)

LIBRARY.define("fp8_group_quantise_gradient(Tensor x, str format, str grouping, int group_size, "
               "str rule, str scale_rounding, int margin, bool saturate) -> Tensor")


def check_group_cast(x: torch.Tensor, fmt_name: str, grouping: str, group_size: int, rule: str,
                     scale_rounding: str, margin: int, saturate: bool) -> None:
    """ValueError (TypeError for the tensor) unless the grouped ops take these arguments, as
    the PopART ops check their attributes."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.dim() != 2:
        raise TypeError("the grouped FP8 ops take a 2-D float32 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)} of shape "
                        f"{tuple(getattr(x, 'shape', ()))}")
    if fmt_name not in ELEMENT_GRIDS:
        raise ValueError(f"the grouped FP8 ops take {', '.join(ELEMENT_GRIDS)} elements, not "
                         f"{fmt_name!r}")
    Grouping(grouping, group_size)
    if grouping == "tensor":
        raise ValueError("a 'tensor' grouping is the per-tensor Fp8Quantise op, not a group op")
    if (rule, scale_rounding) not in (("amax", "floor"), ("mx", "floor"), ("mx", "up")):
        raise ValueError(f"the grouped FP8 ops take rule 'amax' (scale_rounding 'floor') or "
                         f"'mx' ('floor' or 'up'), not {rule!r} with {scale_rounding!r}")
    check_margin(margin)
    if not isinstance(saturate, bool):
        raise ValueError(f"saturate must be a bool, got {saturate!r}")
    if not saturate and (ELEMENT_GRIDS[fmt_name][1] or rule == "mx"):
        raise ValueError(f"{fmt_name} elements with rule {rule!r} saturate: saturate must be "
                         "True")


def group_quantise_attributes(fmt_name: str, grouping: str, group_size: int, rule: str,
                              scale_rounding: str, margin: int, saturate: bool
                              ) -> Dict[str, Any]:
    """The PopART attributes of ``Fp8GroupQuantise`` and ``Fp8GroupGradientQuantise``, as
    ``custom_ops/fp8_group_quantise.cpp`` reads them."""
    return {"format": fmt_name, "grouping": grouping, "group_size": int(group_size),
            "rule": rule, "scale_rounding": scale_rounding, "margin": int(margin),
            "saturate": int(saturate)}


def _identity_kernel(x: torch.Tensor, format: str, grouping: str, group_size: int, rule: str,
                     scale_rounding: str, margin: int, saturate: bool) -> torch.Tensor:
    check_group_cast(x, format, grouping, group_size, rule, scale_rounding, margin, saturate)
    return x.clone()


def _identity_meta(x: torch.Tensor, format: str, grouping: str, group_size: int, rule: str,
                   scale_rounding: str, margin: int, saturate: bool) -> torch.Tensor:
    group_scale_shape(x.shape[0], x.shape[1], Grouping(grouping, group_size))
    return torch.empty_like(x)


class _GroupQuantiseGradient(torch.autograd.Function):
    """The gradient op's Autograd kernel: identity forward, the gradient cast by groups."""

    @staticmethod
    def forward(ctx, x, *attributes):  # type: ignore[override]
        ctx.attributes = attributes
        with _below_autograd():
            return torch.ops.ipu_unit_scaling.fp8_group_quantise_gradient(x, *attributes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        values, _, _ = torch.ops.ipu_unit_scaling.fp8_group_quantise(
            grad.contiguous(), *ctx.attributes)
        return (values,) + (None,) * len(ctx.attributes)


def _identity_autograd(x: torch.Tensor, format: str, grouping: str, group_size: int, rule: str,
                       scale_rounding: str, margin: int, saturate: bool) -> torch.Tensor:
    return _GroupQuantiseGradient.apply(  # type: ignore[no-any-return]
        x, format, grouping, group_size, rule, scale_rounding, margin, saturate)


LIBRARY.impl("fp8_group_quantise_gradient", _identity_kernel, "CompositeExplicitAutograd")
LIBRARY.impl("fp8_group_quantise_gradient", _identity_meta, "Meta")
LIBRARY.impl("fp8_group_quantise_gradient", _identity_autograd, "Autograd")


def _arguments(x: torch.Tensor, fmt_name: str, grouping: Grouping, rule: str, margin: int,
               saturate: bool, scale_rounding: str) -> Tuple[Any, ...]:
    # The amax rule has one rounding; the ops name it "floor" whatever the config says.
    rounding = scale_rounding if rule == "mx" else "floor"
    arguments = (fmt_name, grouping.kind, grouping.size, rule, rounding, margin, saturate)
    check_group_cast(x, *arguments)
    return arguments


def grouped_quantise(x: torch.Tensor, fmt_name: str, grouping: Grouping, rule: str = "amax",
                     margin: int = 0, saturate: bool = True, scale_rounding: str = "floor"
                     ) -> torch.Tensor:
    """The grouped cast's values of the 2-D ``x`` (its dtype), one op whose gradient passes
    straight through: ``Fp8GroupQuantise`` through the implementation given to
    :func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing` where it has it, else the
    ``torch.library`` op."""
    arguments = _arguments(x, fmt_name, grouping, rule, margin, saturate, scale_rounding)
    custom_ops = tracing.fp8_custom_ops()
    if isinstance(custom_ops, tracing.GroupQuantiseOps):
        return custom_ops.group_quantise(x, *arguments)
    values, _, _ = torch.ops.ipu_unit_scaling.fp8_group_quantise(x, *arguments)
    return values  # type: ignore[no-any-return]


def grouped_quantise_gradient(x: torch.Tensor, fmt_name: str, grouping: Grouping,
                              rule: str = "amax", margin: int = 0, saturate: bool = True,
                              scale_rounding: str = "floor") -> torch.Tensor:
    """The identity on the 2-D ``x``, whose gradient is cast as :func:`grouped_quantise` casts:
    one op (``Fp8GroupGradientQuantise``), dispatched as :func:`grouped_quantise` is."""
    arguments = _arguments(x, fmt_name, grouping, rule, margin, saturate, scale_rounding)
    custom_ops = tracing.fp8_custom_ops()
    if isinstance(custom_ops, tracing.GroupQuantiseOps):
        return custom_ops.group_quantise_gradient(x, *arguments)
    return torch.ops.ipu_unit_scaling.fp8_group_quantise_gradient(  # type: ignore[no-any-return]
        x, *arguments)

"""FP8 in PopXL: the AMAX scaling bias from PopXL ops, scaled casts, and the FP8 linear layer.

Written once against ``xl``, the ``popxl`` module or its stand-in
:mod:`ipu_standins.popxl`. The sign convention is the package's:
``q = cast(x * 2**s)``, ``x ~= q * 2**-s``, ``s = clamp(floor(log2(fmt.max / amax)) - margin,
-31, 31)``, which is also what ``ops.pow2scale_cast_to_fp8(x, s, dtype)`` computes. A matmul of
two FP8 tensors cast with biases ``sa`` and ``sb`` is undone with ``matmul_pow2scaled(...,
-(sa + sb))``.

PopART cannot differentiate FP8 ops (their ``getGradOps`` throw), so the FP8 linear layer is a
pair of graphs, forward and backward, the backward written by hand: it casts the incoming
gradient to ``float8_152`` (AMAX margin 3 by default) and multiplies it with the FP8 input and
weight the forward pass kept, applying unit scaling's grad-input and grad-weight scales there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ... import ops as U
from ...fp8.fp8_config import FP8Config
from ...fp8.fp8_formats import FP8Format
from ...fp8.scaling import MAX_LOG2_SCALE
from ...ops.scale_constraints import ConstraintArg
from .codelets import fp8_dtype

__all__ = ["AMAX_SOURCES", "scaling_bias", "popxl_cast_to_fp8", "popxl_fp8_matmul",
           "FP8LinearBlock", "CastSite"]

Tensor = Any  # a popxl.Tensor, the real one's or the stand-in's

# matmul_pow2scaled takes biases in [-32, 32) (docs/popxl/datatype.rst); two casts can ask for
# up to +-62, so the rest is applied as an exact power of two looked up from this table.
_FUSED_LOW, _FUSED_HIGH = -32, 31
_TABLE_LOW = -MAX_LOG2_SCALE
_POW2_TABLE = np.array([math.ldexp(1.0, k) for k in range(_TABLE_LOW, MAX_LOG2_SCALE + 1)],
                       np.float32)


def scaling_bias(xl: Any, amax: Tensor, fmt: FP8Format, margin: int) -> Tuple[Tensor, Tensor]:
    """``(s, non_finite)`` for float32 ``amax`` (any shape, elementwise): exactly
    :func:`fp8.log2_scale`, as int32, and a bool flag.

    ``floor(log2(fmt.max / amax))`` from ``log2`` and a rounded division can be off by one
    next to powers of two. Instead ``amax`` is compared with the exact float32 thresholds
    ``fmt.max * 2**-t``: ``amax <= fmt.max * 2**-t`` holds exactly for ``t <= floor(...)``, so
    counting the thresholds ``amax`` exceeds, over the 62 values of ``t`` the clamp can tell
    apart, gives the clamped bias. ``amax == 0`` gives 0; a non-finite ``amax`` gives 0 and
    ``non_finite`` true, like the codelets' ScalingBias vertex (a graph cannot raise).
    """
    ops = xl.ops
    # s = clamp(t* - margin, -31, 31) only needs t* = floor(...) clamped to [low, high].
    low, high = margin - MAX_LOG2_SCALE, margin + MAX_LOG2_SCALE
    thresholds = [math.ldexp(fmt.max, -t) for t in range(low + 1, high + 1)]
    table = np.array(thresholds, np.float32)
    if [float(v) for v in table] != thresholds:  # would break exactness; cannot for F143/F152
        raise ValueError(f"{fmt.name} thresholds are not exact in float32 for margin {margin}")
    column = amax.reshape(tuple(amax.shape) + (1,))
    exceeded = ops.sum(ops.cast(ops.greater(column, xl.constant(table, xl.float32)), xl.int32),
                       axis=-1)
    bias = xl.constant(high - margin, xl.int32) - exceeded
    finite = ops.isfinite(amax)
    usable = ops.logical_and(finite, ops.greater(amax, xl.constant(0.0, xl.float32)))
    bias = ops.where(usable, bias, xl.constant(0, xl.int32))
    return bias, ops.logical_not(finite)


AMAX_SOURCES = ("ops", "codelets")


def popxl_cast_to_fp8(xl: Any, x: Tensor, fmt: FP8Format, margin: int, config: FP8Config,
                amax: str = "ops") -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(codes, s, non_finite)``: AMAX scaling with ``margin``, or the static bias 0.

    ``amax="ops"`` computes the bias with PopXL ops (:func:`scaling_bias`) and casts with
    ``pow2scale_cast_to_fp8``; ``amax="codelets"`` does both in the codelets' custom op
    (:mod:`.codelets`). Static casts with ``overflow="saturate"`` clip first, so the result
    does not depend on the device's overflow mode; AMAX scaling cannot overflow
    (``amax * 2**s <= max``)."""
    ops = xl.ops
    saturate = config.overflow == "saturate"
    if config.scaling == "amax" and amax == "codelets":
        from .codelets import popxl_fp8_amax_cast

        return popxl_fp8_amax_cast(xl, x, fmt, margin, saturate)
    if amax not in AMAX_SOURCES:
        raise ValueError(f"amax must be one of {AMAX_SOURCES}, got {amax!r}")
    non_finite = None
    if config.scaling == "amax":
        bias, non_finite = scaling_bias(xl, ops.max(ops.abs(x)), fmt, margin)
    else:
        bias = xl.constant(0, xl.int32)
        if saturate:
            x = ops.clip(x, -fmt.max, fmt.max)
    return ops.pow2scale_cast_to_fp8(x, bias, fp8_dtype(xl, fmt)), bias, non_finite


def popxl_fp8_matmul(xl: Any, a: Tensor, a_bias: Tensor, b: Tensor, b_bias: Tensor,
               post_scale: float) -> Tensor:
    """``(a @ b)`` of two FP8 tensors in their unscaled units, times ``post_scale``, float32.

    The matmul output is float16 (``matmul_pow2scaled`` accumulates in half); the combined
    bias is fused into it as far as its range allows, so the float16 result stays in range."""
    ops = xl.ops
    combined = -(a_bias + b_bias)
    fused = ops.clip(combined, _FUSED_LOW, _FUSED_HIGH)
    rest = combined - fused
    # A one-element index rather than a scalar one: the gather then needs no rank-0 support.
    factor = ops.gather(xl.constant(_POW2_TABLE, xl.float32), (rest - _TABLE_LOW).reshape((1,)))
    product = ops.cast(ops.matmul_pow2scaled(a, b, fused), xl.float32)
    return product * (factor * post_scale)


def count_flags(xl: Any, flags: Sequence[Optional[Tensor]]) -> Tensor:
    """How many of ``flags`` (bool or 0/1 int32 scalars; None for casts that cannot flag) are
    set, as int32."""
    total = xl.constant(0, xl.int32)
    for flag in flags:
        if flag is not None:
            total = total + xl.ops.cast(flag, xl.int32)
    return total


@dataclass(frozen=True)
class CastSite:
    """One FP8 cast of a call: ``site`` as :func:`ipu_unit_scaling.transforms.simulate_fp8`
    names it (the module's qualified name), ``role`` "input", "weight" or "grad_output"; codes
    and bias tensors."""

    site: str
    role: str
    codes: Tensor
    log2_scale: Tensor


class FP8LinearBlock:
    """A unit-scaled FP8 linear layer as two PopXL graphs, for any number of calls.

    Forward ``(x, weight[, bias]) -> y`` with ``y = (fp8(x) @ fp8(weight).T + bias) *
    output_scale``; backward ``g -> (grad_x, grad_weight[, grad_bias])`` from the FP8 ``g``, with
    unit scaling's grad-input and grad-weight scales applied to the products, exactly where
    :class:`~ipu_unit_scaling.fp8.FP8UnitScaledLinear` applies them.
    """

    def __init__(self, xl: Any, ir: Any, x: Tensor, weight: Tensor, bias: bool,
                 constraint: ConstraintArg, config: FP8Config, amax: str = "ops"):
        self.xl = xl
        self.config = config
        self.bias = bias
        ops = xl.ops
        x_shape = tuple(x.shape)
        out_features, in_features = weight.shape
        rows = int(np.prod(x_shape[:-1]))
        output_scale, grad_input_scale, grad_weight_scale = U.linear_scales(
            in_features, out_features, rows, constraint)
        c = config

        def forward(*inputs: Tensor) -> Tuple[Tensor, ...]:
            x8, x_bias, x_flag = popxl_cast_to_fp8(xl, inputs[0].reshape((rows, in_features)),
                                                   c.activation, c.activation_margin, c, amax)
            w8, w_bias, w_flag = popxl_cast_to_fp8(xl, inputs[1], c.weight, c.weight_margin, c,
                                                   amax)
            y = popxl_fp8_matmul(xl, x8, x_bias, w8.transpose(), w_bias, output_scale)
            y = y.reshape(x_shape[:-1] + (out_features,))
            if bias:  # (times the output scale, as `U.linear` adds it)
                y = y + inputs[2] * output_scale
            return y, x8, w8, x_bias, w_bias, count_flags(xl, [x_flag, w_flag])

        def backward(g: Tensor, x8: Tensor, w8: Tensor, x_bias: Tensor, w_bias: Tensor
                     ) -> Tuple[Tensor, ...]:
            g2 = g.reshape((rows, out_features))
            g8, g_bias, g_flag = popxl_cast_to_fp8(xl, g2, c.gradient, c.gradient_margin, c, amax)
            grad_x = popxl_fp8_matmul(xl, g8, g_bias, w8, w_bias, grad_input_scale).reshape(x_shape)
            grad_w = popxl_fp8_matmul(xl, g8.transpose(), g_bias, x8, x_bias, grad_weight_scale)
            grads = [grad_x, grad_w]
            if bias:
                grads.append(ops.sum(g2, axis=0) * grad_weight_scale)
            # The cast is returned too, so that the host can inspect it.
            return (*grads, g8, g_bias, count_flags(xl, [g_flag]))

        examples = [x, weight] + ([xl.TensorSpec((out_features,), xl.float32)] if bias else [])
        self.forward_graph = ir.create_graph(forward, *examples)
        y_spec = xl.TensorSpec(x_shape[:-1] + (out_features,), xl.float32)
        codes_x = xl.TensorSpec((rows, in_features), fp8_dtype(xl, c.activation))
        codes_w = xl.TensorSpec((out_features, in_features), fp8_dtype(xl, c.weight))
        scalar = xl.TensorSpec((), xl.int32)
        self.backward_graph = ir.create_graph(backward, y_spec, codes_x, codes_w, scalar, scalar)

    def forward(self, inputs: Sequence[Tensor], site: str, casts: List[CastSite],
                flags: List[Tensor]) -> Tuple[Tuple[Tensor, ...], Any]:
        y, x8, w8, x_bias, w_bias, flag = self.xl.ops.call(self.forward_graph, *inputs)
        casts += [CastSite(site, "input", x8, x_bias), CastSite(site, "weight", w8, w_bias)]
        flags.append(flag)
        return (y,), (x8, w8, x_bias, w_bias, site)

    def backward(self, saved: Any, output_grads: Sequence[Tensor], casts: List[CastSite],
                 flags: List[Tensor]) -> List[Optional[Tensor]]:
        x8, w8, x_bias, w_bias, site = saved
        *grads, g8, g_bias, flag = self.xl.ops.call(self.backward_graph, output_grads[0], x8,
                                                    w8, x_bias, w_bias)
        casts.append(CastSite(site, "grad_output", g8, g_bias))
        flags.append(flag)
        return list(grads)

"""Helpers for writing unit-scaled ops and models: elementwise scaling, RMS, interpolation, and
u-μP's residual rule for transformer stacks."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from . import rule_switch
from .scale_constraints import ConstraintArg, apply_constraint
from .scaling_primitive import scale_bwd, scale_fwd

__all__ = [
    "scale_elementwise", "logarithmic_interpolation", "rms", "ResidualScalingFn",
    "transformer_residual_scaling_rule",
]

ResidualScalingFn = Callable[[int, int], float]


def scale_elementwise(
    f: Callable[..., Tensor],
    output_scale: float,
    grad_input_scale: float,
    constraint: ConstraintArg = "to_output_scale",
) -> Callable[..., Tensor]:
    """`f` (called as `f(input, *args, **kwargs)`) with its output multiplied by `output_scale`
    in the forward pass and its input's gradient by `grad_input_scale`, after `constraint`."""
    output_scale, grad_input_scale = apply_constraint(constraint, output_scale, grad_input_scale)

    def scaled(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return scale_fwd(f(scale_bwd(input, grad_input_scale), *args, **kwargs), output_scale)

    return scaled


def logarithmic_interpolation(alpha: float, lower: float, upper: float) -> float:
    """`lower**(1 - alpha) * upper**alpha`: `lower` at alpha 0, `upper` at 1, a constant ratio
    per step in between (both must be positive)."""
    return math.exp(alpha * math.log(upper) + (1 - alpha) * math.log(lower))


def rms(x: Tensor, dims: Optional[Tuple[int, ...]] = None, keepdim: bool = False,
        eps: float = 0.0) -> Tensor:
    """`sqrt(mean(x**2) + eps)` over `dims` (all by default), computed in float32 or wider
    (float64 stays float64; under `rules("unit-scaling")` it is computed in float32, as
    unit-scaling 0.3.5 computes it)."""
    wide = x.dtype == torch.float64 and not rule_switch.library_rules()
    squares = (x if wide else x.float()).pow(2)
    mean_square = squares.mean() if dims is None else squares.mean(dims, keepdim=keepdim)
    if eps:
        mean_square = mean_square + eps
    return mean_square.sqrt().to(x.dtype)


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> ResidualScalingFn:
    """u-μP's residual weights for a stack that alternates attention and MLP branches after an
    embedding: `fn(index, layers) -> tau` for branch `index` of `layers` (even: attention).

    Every attention branch then contributes the same share of the residual stream's variance,
    and so does every MLP branch; attention and MLP together weigh `residual_mult**2` times the
    embedding on average, attention against MLP `residual_attn_ratio**2` (the u-μP paper's
    appendix G). A branch of weight `a` joining a stream of summed weight `W` gets
    `tau = a / sqrt(W)`, with `a_mlp**2 = 2 residual_mult**2 / (1 + residual_attn_ratio**2)`,
    `a_attn = residual_attn_ratio * a_mlp`, and the embedding weighing `layers / 2`.
    """
    mlp = residual_mult * math.sqrt(2 / (1 + residual_attn_ratio**2))
    attention = residual_attn_ratio * mlp

    def tau(index: int, layers: int) -> float:
        earlier_attention, earlier_mlp = (index + 1) // 2, index // 2
        stream = layers / 2 + earlier_attention * attention**2 + earlier_mlp * mlp**2
        return (attention if index % 2 == 0 else mlp) / math.sqrt(stream)

    return tau

"""Unit-scaled ops of current language models (Llama and its kin): RMSNorm, SiLU, SwiGLU.

They are part of `ipu_unit_scaling.functional` (`U.rms_norm`, `U.silu`, `U.silu_glu`); this
module only keeps `functional.py` to a readable length. Like every op of the package they are
built from `scale` / `scale_bwd` and ordinary ops, so their PopTorch form (under
`ipu_tracing()`) has the same values and gradients as the eager one.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import rule_switch
from .scale_constraints import ConstraintArg, apply_constraint
from .scaling_primitive import scale_bwd
from .trace_switch import is_ipu_tracing
from .unit_ops import scaled_call

__all__ = ["rms_norm", "silu", "silu_glu"]


def _silu_moments(mult: float = 1.0) -> Tuple[float, float, float]:
    """(std of f(z), rms of f(z), rms of f'(z)) for f(z) = z sigmoid(mult z), z ~ N(0, 1), by
    quadrature (f is silu(mult z) / mult; at mult 1, silu itself).

    f and f'(z) = s (1 + mult z (1 - s)), s = sigmoid(mult z), are smooth, so 160-point
    Gauss-Hermite quadrature in float64 is exact to far below float32 precision.
    """
    points, weights = np.polynomial.hermite_e.hermegauss(160)
    weights = weights / weights.sum()
    sigmoid = 1.0 / (1.0 + np.exp(-mult * points))
    value = points * sigmoid
    slope = sigmoid * (1.0 + mult * points * (1.0 - sigmoid))
    mean = float(np.dot(weights, value))
    mean_square = float(np.dot(weights, value**2))
    return (math.sqrt(mean_square - mean**2), math.sqrt(mean_square),
            math.sqrt(float(np.dot(weights, slope**2))))


# Computed once at import (torch.compile would otherwise trace the numpy call).
SILU_MOMENTS = _silu_moments()
_silu_mult_moments = lru_cache(maxsize=256)(_silu_moments)


def _moments(mult: float) -> Tuple[float, float, float]:
    if not mult > 0 or math.isinf(mult):
        raise ValueError(f"mult={mult!r} must be positive and finite")
    return SILU_MOMENTS if mult == 1.0 else _silu_mult_moments(float(mult))


def _silu(x: Tensor, mult: float) -> Tensor:
    return F.silu(x) if mult == 1.0 else x * torch.sigmoid(x * mult)


def silu(input: Tensor, mult: Union[float, bool] = 1.0,
         constraint: ConstraintArg = "to_output_scale", inplace: bool = False) -> Tensor:
    """Unit-scaled SiLU (swish) `x * sigmoid(mult * x)` (`F.silu` at mult 1).

    Rule: output scale 1/std(f(z)) (about 1/0.560 at mult 1), grad-input scale 1/rms(f'(z))
    (about 1/0.616) for z ~ N(0, 1), by quadrature; tied by `constraint`. As with GELU, the
    output keeps the activation's nonzero mean (about 0.21 before scaling): the std, not the
    rms, is unit. `silu(input, True)` (inplace given second, as earlier versions took it) is
    still understood, and refused as any in-place request is. Under `rules("unit-scaling")` the
    scales are unit-scaling 0.3.5's interpolations in mult (`rule_switch.activation_scales`).
    """
    if isinstance(mult, bool):
        inplace = mult
    if inplace:
        raise ValueError("inplace=True is not supported by the unit-scaled op: the scaled "
                         "output is a new tensor")
    multiplier = 1.0 if isinstance(mult, bool) else float(mult)
    out_std, _, slope_rms = _moments(multiplier)
    if rule_switch.library_rules():
        output_scale, grad_scale = apply_constraint(
            constraint, *rule_switch.activation_scales("silu", multiplier))
    else:
        output_scale, grad_scale = apply_constraint(constraint, 1 / out_std, 1 / slope_rms)
    return scaled_call(lambda x: _silu(x, multiplier), (input,), output_scale, (grad_scale,),
                        scale_in_place=True)


def silu_glu(input: Tensor, gate: Tensor, mult: Union[float, ConstraintArg] = 1.0,
             constraint: ConstraintArg = "to_output_scale") -> Tensor:
    """Unit-scaled SwiGLU product `input * gate * sigmoid(mult * gate)` (`input * silu(gate)` at
    mult 1), the heart of Llama's gated MLP.

    Rule: for independent unit-normal `input` u and `gate` g, and f(z) = z sigmoid(mult z), the
    product u f(g) has zero mean and rms(f) (about 0.596 at mult 1); the gradient of u is
    grad * f(g), again of rms rms(f); the gradient of g is grad * u * f'(g), of rms rms(f')
    (about 0.616). Output scale 1/rms(f), grad scales 1/rms(f) (input) and 1/rms(f') (gate), all
    three tied by `constraint`: both inputs are activations (the up and gate projections).
    A constraint given third (as earlier versions took it) is still understood. Under
    `rules("unit-scaling")` one scale, unit-scaling 0.3.5's interpolation in mult
    (`rule_switch.silu_glu_scale`), serves the output and both gradients.
    """
    if isinstance(mult, (int, float)):
        gate_mult = float(mult)
    else:
        gate_mult, constraint = 1.0, mult
    _, out_rms, slope_rms = _moments(gate_mult)
    if rule_switch.library_rules():
        # unit-scaling's one scale for the output and both gradients (no constraint to apply).
        output_scale = input_scale = gate_scale = rule_switch.silu_glu_scale(gate_mult)
    else:
        output_scale, input_scale, gate_scale = apply_constraint(
            constraint, 1 / out_rms, 1 / out_rms, 1 / slope_rms
        )
    if input.shape != gate.shape:
        raise ValueError(f"input shape {tuple(input.shape)} != gate shape {tuple(gate.shape)}")
    return scaled_call(lambda u, g: u * _silu(g, gate_mult), (input, gate), output_scale,
                        (input_scale, gate_scale), scale_in_place=True)


def _rms_normalise(input: Tensor, dims: Tuple[int, ...], eps: float) -> Tensor:
    """x / sqrt(mean(x**2) + eps) over `dims`, in float32 for 16-bit inputs (as torch does)."""
    wide = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    normalised = wide * torch.rsqrt(wide.pow(2).mean(dims, keepdim=True) + eps)
    return normalised.to(input.dtype)


def rms_norm(
    input: Tensor,
    normalized_shape: Union[int, Sequence[int]],
    weight: Optional[Tensor] = None,
    eps: Optional[float] = 1e-5,
) -> Tensor:
    """Unit-scaled `F.rms_norm`: `x / sqrt(mean(x**2) + eps) * weight` over the last dims.

    Rule: the output has unit mean square by construction, and for unit input the input
    gradient `(g - y <y, g> / n) / rms(x)` is unit too, so neither is scaled (as for
    `layer_norm`); the weight gradient sums over the rows, so its grad scale is
    `batch_size**-0.5`. `eps=None` is torch's default, the input dtype's machine epsilon.
    Torch before 2.4 has no `F.rms_norm`, and PopTorch no handler for it: there, and under
    `ipu_tracing()`, the same formula is built from pow, mean, rsqrt and mul. Under
    `rules("unit-scaling")`, unit-scaling 0.3.5's form: `x / rms(x)` with the RMS computed in
    float32 whatever the input's type (and `eps=None` adds nothing).
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(input.shape[input.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {shape} does not match the input's trailing "
                         f"dimensions {tuple(input.shape)}")
    batch_size = max(1, input.numel() // max(1, math.prod(shape)))
    if weight is not None:
        weight = scale_bwd(weight, batch_size**-0.5)
    if rule_switch.library_rules():
        # unit-scaling's form: divided by the RMS, which is computed in float32 (for a float64
        # input too) and cast back to the input's type.
        squares = input.float().pow(2).mean(tuple(range(-1, -1 - len(shape), -1)), keepdim=True)
        if eps:
            squares = squares + eps
        out = input / squares.sqrt().to(input.dtype)
        return out * weight if weight is not None else out
    fused = getattr(F, "rms_norm", None)
    if fused is not None and not is_ipu_tracing():
        return fused(input, shape, weight, eps)
    epsilon = torch.finfo(input.dtype).eps if eps is None else eps
    out = _rms_normalise(input, tuple(range(-len(shape), 0)), epsilon)
    return out * weight if weight is not None else out

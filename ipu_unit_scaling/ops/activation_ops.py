"""Unit-scaled nonlinearities and dropout: gelu (with u-μP's ``mult``), relu, softmax and
dropout, with the moments their scales come from."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_ops as fused
from . import ipu_lowering as lowering
from . import rule_switch
from .scale_constraints import ConstraintArg, apply_constraint
from .softmax_moments import softmax_moments
from .trace_switch import is_ipu_tracing
from .unit_ops import reject_argument, scaled_call

__all__ = [
    "gelu",
    "relu",
    "softmax",
    "dropout",
]


# ---------------------------------------------------------------- nonlinearities

_HERMITE_POINTS, _HERMITE_WEIGHTS = np.polynomial.hermite_e.hermegauss(160)
_HERMITE_WEIGHTS = _HERMITE_WEIGHTS / _HERMITE_WEIGHTS.sum()


def _normal_std(values: np.ndarray) -> float:
    """Std of f(z), z ~ N(0, 1), from f evaluated at Gauss-Hermite points."""
    mean = float(np.dot(_HERMITE_WEIGHTS, values))
    return math.sqrt(float(np.dot(_HERMITE_WEIGHTS, values**2)) - mean**2)


def _normal_rms(values: np.ndarray) -> float:
    return math.sqrt(float(np.dot(_HERMITE_WEIGHTS, values**2)))


def gelu_moments(form: str, mult: float = 1.0) -> Tuple[float, float]:
    """(std of gelu(mult z), rms of its gradient in z) for z ~ N(0, 1), in float64, for a GELU
    form of `lowering.GELU_FORMS`: torch's "none" and "tanh", or "popart", what an IPU runs
    (the tanh forward with popnn's gradient, which is not that forward's derivative)."""
    # Autograd must record even when the first call comes under no_grad or inference_mode.
    with torch.inference_mode(False), torch.enable_grad():
        z = torch.tensor(_HERMITE_POINTS, dtype=torch.float64, requires_grad=True)
        out = lowering.gelu_of_form(mult * z, form)
        (slope,) = torch.autograd.grad(out.sum(), z)
    return _normal_std(out.detach().numpy()), _normal_rms(slope.numpy())


@lru_cache(maxsize=None)
def _gelu_stds(form: str) -> Tuple[float, float]:
    """(std of gelu(z), rms of its gradient) for z ~ N(0, 1): see `gelu_moments`."""
    return gelu_moments(form)


# Computed once at import: torch.compile traces through lru_cache, and tracing the autograd call
# above would split the compiled graph at every GELU.
GELU_STDS = {form: _gelu_stds(form) for form in lowering.GELU_FORMS}


def active_gelu_form(approximate: str) -> str:
    """The GELU that runs for `F.gelu(x, approximate)`: under `ipu_tracing()` the one PopTorch
    lowers it to (`lowering.gelu_on_ipu`), else torch's."""
    if is_ipu_tracing() and lowering.follows_ipu_numerics():
        return lowering.gelu_on_ipu(approximate)
    return approximate

# Closed forms for z ~ N(0, 1): relu(z) has variance 1/2 - 1/(2 pi); relu'(z) is 1 half the time.
_RELU_STD = math.sqrt(0.5 - 0.5 / math.pi)
_RELU_GRAD_RMS = math.sqrt(0.5)


@lru_cache(maxsize=256)
def _gelu_mult_moments(form: str, mult: float) -> Tuple[float, float]:
    """`gelu_moments(form, mult)`, remembered: u-μP's `mult` is fixed per model."""
    return gelu_moments(form, mult)


def gelu_scales(form: str, constraint: ConstraintArg, mult: float = 1.0) -> Tuple[float, ...]:
    """Scales for a GELU form (an `approximate` of `F.gelu`, or "popart") of `mult * x`."""
    if mult != 1.0:
        out_std, grad_rms = _gelu_mult_moments(form, float(mult))
    elif form in GELU_STDS:
        out_std, grad_rms = GELU_STDS[form]
    else:
        out_std, grad_rms = _gelu_stds(form)
    return apply_constraint(constraint, 1 / out_std, 1 / grad_rms)


def positive_mult(mult: float) -> float:
    """`mult` as a float; ValueError unless it is positive and finite."""
    if not mult > 0 or math.isinf(mult):
        raise ValueError(f"mult={mult!r} must be positive and finite")
    return float(mult)


def gelu(
    input: Tensor,
    mult: Union[float, str] = 1.0,
    constraint: ConstraintArg = "to_output_scale",
    approximate: str = "none",
) -> Tensor:
    """Unit-scaled `F.gelu` of `mult * input` (u-μP's `ffn_act_mult`).

    Rule: output scale 1/std(h(z)), grad-input scale 1/rms(h'(z)) for h(z) = gelu(mult z) and
    z ~ N(0, 1), computed by quadrature in float64; tied by `constraint`. The result is that of
    unit_scaling's `gelu(input, mult)` (`gelu(mult x) / mult`, unit-scaled), whose division by
    mult the output scale absorbs. Under `ipu_tracing()` these are the moments of the GELU an
    IPU runs: PopTorch lowers both `approximate` values to PopART's tanh approximation, whose
    gradient is popnn's (see `ipu_unit_scaling.ops.ipu_lowering`). `gelu(input, "tanh")` (the
    approximation given second, as earlier versions took it) is still understood.
    Under `rules("unit-scaling")` the scales are unit-scaling 0.3.5's interpolations in mult
    (`rule_switch.activation_scales`).
    """
    if isinstance(mult, str):
        approximate = mult
    multiplier = positive_mult(1.0 if isinstance(mult, str) else mult)
    if rule_switch.library_rules():
        # unit-scaling's gelu(mult x) / mult: its output scale over mult, and mult's factor in
        # the derivative taken back out of the gradient scale.
        output_scale, grad_scale = apply_constraint(
            constraint, *rule_switch.activation_scales("gelu", multiplier))
        output_scale, grad_scale = output_scale / multiplier, grad_scale / multiplier
    elif fused.eager_forms():
        output_scale, grad_scale = fused.cached_scales(
            ("gelu", approximate, multiplier, constraint), gelu_scales, approximate,
            constraint, multiplier)
    else:
        output_scale, grad_scale = gelu_scales(active_gelu_form(approximate), constraint,
                                                multiplier)
    if fused.eager_forms():
        return fused.gelu(input if multiplier == 1.0 else input * multiplier, approximate,
                          output_scale, grad_scale)
    # The derivative of gelu(mult x) carries mult: the scaled call sees gelu at mult x.
    return scaled_call(
        lambda x: F.gelu(x if multiplier == 1.0 else x * multiplier, approximate=approximate),
        (input,), output_scale, (grad_scale,), scale_in_place=True,
    )


def relu(input: Tensor, inplace: bool = False,
         constraint: ConstraintArg = "to_output_scale") -> Tensor:
    """Unit-scaled `F.relu`.

    Rule: output scale 1/sqrt(1/2 - 1/(2 pi)), grad-input scale sqrt(2); tied by `constraint`.
    """
    reject_argument("inplace", inplace, False, "the scaled output is a new tensor")
    output_scale, grad_scale = apply_constraint(constraint, 1 / _RELU_STD, 1 / _RELU_GRAD_RMS)
    return scaled_call(F.relu, (input,), output_scale, (grad_scale,))


def expected_softmax_square_sum(n: Union[float, Tensor], logit_std: float = 1.0,
                                 max_keys: Optional[int] = None):
    """E[sum_i p_i**2] for p = softmax of n i.i.d. N(0, logit_std**2) logits.

    For logit_std <= 1, a closed form: the large-n limit of a second-order expansion,
    exp(s**2) / (n + c_inf), with c_inf = 2 (exp(2 s**2) - 1) - 3 (exp(s**2) - 1); for n = 1
    the sum is exactly 1, which fixes c_1 = exp(s**2) - 1; an empirical n**-0.2 blend between
    the two is within 5% of the exact value for every n, 2.5% in the row scale (the tests
    check it against the quadrature). Above s = 1 the expansion fails (the row scale came out
    1.5 times too large at s = 1.5 and 4 times at s = 2), and the quadrature's values
    (`_softmax_moments`) are used, looked up by n; a tensor `n` then needs `max_keys`, its
    largest possible value.
    """
    # The tolerance keeps `scale=1/sqrt(head_dim)` given explicitly (std 1 + 2e-16) on the
    # closed form, as for the default scale.
    if logit_std > 1.0 + 1e-6:
        if isinstance(n, Tensor):
            if max_keys is None:
                raise ValueError("max_keys is needed for a tensor of key counts above logit std 1")
            table = torch.as_tensor(softmax_moments(max(1, max_keys), logit_std)[0],
                                    dtype=n.dtype, device=n.device)
            index = (n.round().long() - 1).clamp(0, max(1, max_keys) - 1)
            return table.index_select(0, index.flatten()).view(n.shape)
        count = max(1, int(round(n)))
        return float(softmax_moments(max(count, max_keys or 1), logit_std)[0][count - 1])
    var = logit_std**2
    c_one = math.exp(var) - 1
    c_inf = 2 * (math.exp(2 * var) - 1) - 3 * c_one
    blend = n**-0.2
    return math.exp(var) / (n + c_inf - (c_inf - c_one) * blend)


def softmax(
    input: Tensor,
    dim: int,
    dtype: Optional[torch.dtype] = None,
    constraint: ConstraintArg = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled `F.softmax` of `mult * input` (u-μP's softmax multiplier).

    Rule: for n = input.shape[dim] unit-normal inputs, the logits have std s = mult and
    `E[p**2] = S(n, s)/n`, where S is the expected sum of squared probabilities (see
    `scaled_dot_product_attention`); output scale `1/sqrt(S/n - 1/n**2)` (the std of p),
    grad-input scale `1/(mult sqrt(S/n))` (the gradient is `mult p * (g - <p, g>)`); tied by
    `constraint`.

    The output's std is made unit, not its root mean square: p's mean 1/n is kept (scaled, it
    is `1/(n std(p))`, 0.76 for n = 4096 at mult 1 and near 4 at mult 1/4, where the
    probabilities are nearly flat). Under `rules("unit-scaling")`, unit-scaling 0.3.5's
    interpolation between the flat and one-hot limits (`rule_switch.softmax_scales`).
    """
    mult = positive_mult(mult)
    n = input.shape[dim]
    if rule_switch.library_rules():
        output_scale, grad_scale = apply_constraint(constraint,
                                                    *rule_switch.softmax_scales(n, mult))
        return scaled_call(
            lambda x: F.softmax(x if mult == 1.0 else x * mult, dim=dim, dtype=dtype), (input,),
            output_scale, (grad_scale,),
        )
    mean_square = expected_softmax_square_sum(n, mult) / n
    out_std = math.sqrt(max(mean_square - 1.0 / n**2, 1e-12))
    output_scale, grad_scale = apply_constraint(
        constraint, 1 / out_std, 1 / (mult * mean_square**0.5))
    return scaled_call(
        lambda x: F.softmax(x if mult == 1.0 else x * mult, dim=dim, dtype=dtype), (input,),
        output_scale, (grad_scale,),
    )


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Unit-scaled `F.dropout`.

    Rule: torch scales kept values by 1/(1-p), giving variance 1/(1-p); a further sqrt(1-p)
    makes the output and its gradient unit (the same factor both ways, so no constraint). In
    eval mode it is the identity; under `rules("unit-scaling")` it multiplies by sqrt(1-p) there
    too, as unit-scaling 0.3.5 does.
    """
    reject_argument("inplace", inplace, False, "the scaled output is a new tensor")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be in [0, 1)")
    if rule_switch.library_rules() and (not training or p == 0.0):
        return input * rule_switch.dropout_scale(p) if p else input
    if not training or p == 0.0:
        return input
    # Dropout's backward uses its mask, not its output, so the fresh output can be scaled in place.
    return F.dropout(input, p, training).mul_(math.sqrt(1 - p))

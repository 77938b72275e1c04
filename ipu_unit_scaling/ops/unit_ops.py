"""Unit-scaled ops, a drop-in for `torch.nn.functional`: `import ipu_unit_scaling.functional as U`.

Each op computes what its torch counterpart computes, multiplied in the forward pass by an output
scale and in the backward pass by a grad-input scale, so that for unit-variance inputs and a
unit-variance output gradient, the output and every input gradient have unit variance. Where an
input is an activation (a non-cut edge), the forward and backward scales are tied by a
`constraint` (see `ipu_unit_scaling.constraints`). Weights and biases are cut edges: their
gradient scales are always free.

Scales depend only on shapes and hyperparameters, never on tensor values, so they are fixed at
trace time and cost nothing on an IPU beyond a multiply.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_ops as fused
from . import ipu_lowering as lowering
from .scale_constraints import ConstraintArg, apply_constraint
from .scaling_primitive import scale, scale_bwd, scale_fwd
from .softmax_moments import query_key_gradient_variance, softmax_moments
from .trace_switch import is_ipu_tracing

__all__ = [
    "linear",
    "linear_scales",
    "linear_readout",
    "conv1d",
    "matmul",
    "gelu",
    "relu",
    "softmax",
    "dropout",
    "layer_norm",
    "embedding",
    "add",
    "residual_split",
    "residual_add",
    "residual_apply",
    "scaled_dot_product_attention",
    "attention_value_bias_grad_scale",
    "attention_query_key_grad_scale",
    "cross_entropy",
    "mse_loss",
]


def _scaled_call(
    fn,
    inputs: Sequence[Tensor],
    output_scale: float,
    grad_scales: Sequence[float],
    scale_in_place: bool = False,
):
    """`fn(*inputs) * output_scale` with the gradient of input i scaled by `grad_scales[i]`.

    The output multiply is a plain one, so it also scales every input gradient by
    `output_scale`; each input then only needs the ratio, which is 1 (no op) when tied.

    `scale_in_place` multiplies fn's fresh output in place: the same values and gradients
    without allocating a second output-sized tensor. Only for ops whose backward does not use
    their output (gelu, matmul, add; not relu or softmax, which autograd would then reject).
    """
    adjusted = [scale_bwd(x, g / output_scale) for x, g in zip(inputs, grad_scales)]
    out = fn(*adjusted)
    if output_scale == 1.0:
        return out
    return out.mul_(output_scale) if scale_in_place else out * output_scale


def _reject(name: str, value: object, default: object, why: str) -> None:
    if value is not default and (isinstance(value, Tensor) or value != default):
        shown = f"<tensor {tuple(value.shape)}>" if isinstance(value, Tensor) else repr(value)
        raise ValueError(f"{name}={shown} is not supported by the unit-scaled op: {why}")


# ---------------------------------------------------------------- matmuls


ScalePower = Tuple[float, float, float]
_UNIT_POWER: ScalePower = (0.5, 0.5, 0.5)


def linear_scales(
    fan_in: int, fan_out: int, batch_size: int, constraint: ConstraintArg = "to_output_scale",
    scale_power: ScalePower = _UNIT_POWER,
) -> Tuple[float, float, float]:
    """(output, grad-input, grad-weight) scales of a unit-scaled linear, after `constraint`:
    `fan_in**-p0`, `fan_out**-p1` and `batch_size**-p2` for `scale_power` (p0, p1, p2).

    A zero size sums nothing; it counts as 1, so empty tensors pass through like torch's.
    """
    fan_in, fan_out, batch_size = max(1, fan_in), max(1, fan_out), max(1, batch_size)
    output_power, input_power, weight_power = scale_power
    output_scale, grad_input_scale = apply_constraint(
        constraint, fan_in**-output_power, fan_out**-input_power)
    return output_scale, grad_input_scale, batch_size**-weight_power


def linear(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    constraint: ConstraintArg = "to_output_scale",
    scale_power: ScalePower = _UNIT_POWER,
) -> Tensor:
    """Unit-scaled `F.linear`.

    Rule: output scale `fan_in**-0.5` (sum over inputs), grad-input scale `fan_out**-0.5` (sum over
    outputs), tied by `constraint`; weight and bias grad scale `batch_size**-0.5`, where
    batch_size is the number of rows the weight gradient sums over. `scale_power` replaces the
    three exponents 0.5 (`linear_readout` uses 1 for the output).
    """
    fan_out, fan_in = weight.shape
    batch_size = max(1, input.numel() // max(1, fan_in))
    if fused.eager_forms():
        # Every scale goes into a GEMM's alpha: no scaled weight copy, one autograd node.
        scales = fused.cached_scales(
            ("linear", fan_in, fan_out, batch_size, tuple(scale_power), constraint),
            linear_scales, fan_in, fan_out, batch_size, constraint, scale_power)
        return fused.linear(input, weight, bias, *scales)
    output_scale, grad_input_scale, grad_weight_scale = linear_scales(
        fan_in, fan_out, batch_size, constraint, scale_power
    )
    if is_ipu_tracing():
        # The PopTorch form. The output scale is folded into the weight: a multiply on the
        # (small) weight instead of the (large) activation, and the backward multiply then
        # reaches the input gradient for free.
        weight = scale(weight, output_scale, grad_weight_scale)
        input = scale_bwd(input, grad_input_scale / output_scale)
        if bias is not None:
            bias = scale_bwd(bias, grad_weight_scale)
        return F.linear(input, weight, bias)
    # Under torch.compile and graph transforms: the matmul sees the unscaled input and weight
    # (what `transforms.simulate_fp8` casts); the compiler fuses the output's multiply.
    out = scale_fwd(F.linear(scale_bwd(input, grad_input_scale),
                             scale_bwd(weight, grad_weight_scale)), output_scale)
    return out if bias is None else out + scale_bwd(bias, grad_weight_scale)


def linear_readout(
    input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, constraint: ConstraintArg = None
) -> Tensor:
    """Unit-scaled linear for a network's output (u-μP's readout).

    Rule: as `linear`, but the output scale is `1 / fan_in` (μP's readout), not
    `fan_in**-0.5`: for unit input and weight the output has std `fan_in**-0.5`. The default
    leaves the scales unconstrained: the readout's input gradient keeps its own unit scale
    `fan_out**-0.5` (a cut edge: nothing after the readout but the loss).
    """
    return linear(input, weight, bias, constraint, scale_power=(1.0, 0.5, 0.5))


def conv1d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
    groups: int = 1,
    constraint: ConstraintArg = "to_output_scale",
    scale_power: ScalePower = _UNIT_POWER,
) -> Tensor:
    """Unit-scaled `F.conv1d` (integer `padding` only).

    Rule: an output sums `(in_channels / groups) * kernel_size` products: output scale that
    count to the power -0.5; an input element reaches `(out_channels / groups) * kernel_size /
    stride` outputs on average: grad-input scale that count to the power -0.5; tied by
    `constraint`. The weight and bias gradients sum over every output position of every batch
    item: grad scale that count to the power -0.5. Zero padding is not counted (positions near
    the ends sum fewer products). `scale_power` replaces the three exponents 0.5.
    """
    if not isinstance(padding, int):
        raise ValueError(f"padding={padding!r}: the unit-scaled conv1d takes an integer padding")
    out_channels, group_in_channels, kernel_size = weight.shape
    length = input.shape[-1]
    out_length = (length + 2 * padding - dilation * (kernel_size - 1) - 1) // stride + 1
    positions = max(1, out_length * (input.shape[:-2].numel() if input.dim() > 2 else 1))
    output_power, input_power, weight_power = scale_power
    output_scale, grad_input_scale = apply_constraint(
        constraint,
        max(1, group_in_channels * kernel_size) ** -output_power,
        (stride * groups / max(1, out_channels * kernel_size)) ** input_power,
    )
    grad_weight_scale = positions**-weight_power
    # As in `linear`'s PopTorch form: the output scale folded into the weight.
    weight = scale(weight, output_scale, grad_weight_scale)
    input = scale_bwd(input, grad_input_scale / output_scale)
    out = F.conv1d(input, weight, None, stride, padding, dilation, groups)
    if bias is None:
        return out
    return out + scale_bwd(bias, grad_weight_scale).unsqueeze(-1)


def _matmul_output_numel(left: Sequence[int], right: Sequence[int]) -> int:
    """Elements of `torch.matmul`'s output, from the shapes alone (no tensors: nothing traced)."""
    if len(left) == 0 or len(right) == 0:
        raise ValueError("matmul needs inputs with at least one dimension")
    rows = [left[-2]] if len(left) > 1 else []
    columns = [right[-1]] if len(right) > 1 else []
    batch = torch.broadcast_shapes(torch.Size(left[:-2]), torch.Size(right[:-2]))
    return math.prod([*batch, *rows, *columns])


def matmul(left: Tensor, right: Tensor, constraint: ConstraintArg = "to_output_scale") -> Tensor:
    """Unit-scaled `torch.matmul`.

    Rule: output scale `k**-0.5` for inner size k; each input's grad scale is
    `count**-0.5`, where count is the number of terms its gradient sums over: k times the
    output elements per input element (n for the left input, m times broadcast batch for the
    right). All three tied by `constraint`.
    """
    out_numel = _matmul_output_numel(left.shape, right.shape)
    inner = max(1, left.shape[-1])
    left_count = max(1, out_numel * inner // max(1, left.numel()))
    right_count = max(1, out_numel * inner // max(1, right.numel()))
    output_scale, left_scale, right_scale = apply_constraint(
        constraint, inner**-0.5, left_count**-0.5, right_count**-0.5
    )
    if left.dim() >= 2 and right.dim() >= 2 and fused.eager_forms():
        return fused.matmul(left, right, output_scale, left_scale, right_scale)
    return _scaled_call(
        torch.matmul, (left, right), output_scale, (left_scale, right_scale), scale_in_place=True
    )


# ---------------------------------------------------------------- nonlinearities

_HERMITE_POINTS, _HERMITE_WEIGHTS = np.polynomial.hermite_e.hermegauss(160)
_HERMITE_WEIGHTS = _HERMITE_WEIGHTS / _HERMITE_WEIGHTS.sum()


def _normal_std(values: np.ndarray) -> float:
    """Std of f(z), z ~ N(0, 1), from f evaluated at Gauss-Hermite points."""
    mean = float(np.dot(_HERMITE_WEIGHTS, values))
    return math.sqrt(float(np.dot(_HERMITE_WEIGHTS, values**2)) - mean**2)


def _normal_rms(values: np.ndarray) -> float:
    return math.sqrt(float(np.dot(_HERMITE_WEIGHTS, values**2)))


def _gelu_moments(form: str, mult: float = 1.0) -> Tuple[float, float]:
    """(std of gelu(mult z), rms of its gradient in z) for z ~ N(0, 1), in float64, for a GELU
    form of `lowering.GELU_FORMS`: torch's "none" and "tanh", or "popart", what an IPU runs
    (the tanh forward with popnn's gradient, which is not that forward's derivative)."""
    # Autograd must record even when the first call comes under no_grad or inference_mode.
    with torch.inference_mode(False), torch.enable_grad():
        z = torch.tensor(_HERMITE_POINTS, dtype=torch.float64, requires_grad=True)
        out = lowering.gelu(mult * z, form)
        (slope,) = torch.autograd.grad(out.sum(), z)
    return _normal_std(out.detach().numpy()), _normal_rms(slope.numpy())


@lru_cache(maxsize=None)
def _gelu_stds(form: str) -> Tuple[float, float]:
    """(std of gelu(z), rms of its gradient) for z ~ N(0, 1): see `_gelu_moments`."""
    return _gelu_moments(form)


# Computed once at import: torch.compile traces through lru_cache, and tracing the autograd call
# above would split the compiled graph at every GELU.
_GELU_STDS = {form: _gelu_stds(form) for form in lowering.GELU_FORMS}


def _gelu_form(approximate: str) -> str:
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
    """`_gelu_moments(form, mult)`, remembered: u-μP's `mult` is fixed per model."""
    return _gelu_moments(form, mult)


def _gelu_scales(form: str, constraint: ConstraintArg, mult: float = 1.0) -> Tuple[float, ...]:
    """Scales for a GELU form (an `approximate` of `F.gelu`, or "popart") of `mult * x`."""
    if mult != 1.0:
        out_std, grad_rms = _gelu_mult_moments(form, float(mult))
    elif form in _GELU_STDS:
        out_std, grad_rms = _GELU_STDS[form]
    else:
        out_std, grad_rms = _gelu_stds(form)
    return apply_constraint(constraint, 1 / out_std, 1 / grad_rms)


def _positive_mult(mult: float) -> float:
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
    """
    if isinstance(mult, str):
        approximate = mult
    multiplier = _positive_mult(1.0 if isinstance(mult, str) else mult)
    if fused.eager_forms():
        output_scale, grad_scale = fused.cached_scales(
            ("gelu", approximate, multiplier, constraint), _gelu_scales, approximate,
            constraint, multiplier)
        return fused.gelu(input if multiplier == 1.0 else input * multiplier, approximate,
                          output_scale, grad_scale)
    output_scale, grad_scale = _gelu_scales(_gelu_form(approximate), constraint, multiplier)
    # The derivative of gelu(mult x) carries mult: the scaled call sees gelu at mult x.
    return _scaled_call(
        lambda x: F.gelu(x if multiplier == 1.0 else x * multiplier, approximate=approximate),
        (input,), output_scale, (grad_scale,), scale_in_place=True,
    )


def relu(input: Tensor, inplace: bool = False,
         constraint: ConstraintArg = "to_output_scale") -> Tensor:
    """Unit-scaled `F.relu`.

    Rule: output scale 1/sqrt(1/2 - 1/(2 pi)), grad-input scale sqrt(2); tied by `constraint`.
    """
    _reject("inplace", inplace, False, "the scaled output is a new tensor")
    output_scale, grad_scale = apply_constraint(constraint, 1 / _RELU_STD, 1 / _RELU_GRAD_RMS)
    return _scaled_call(F.relu, (input,), output_scale, (grad_scale,))


def _expected_softmax_square_sum(n: Union[float, Tensor], logit_std: float = 1.0,
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
    probabilities are nearly flat).
    """
    mult = _positive_mult(mult)
    n = input.shape[dim]
    mean_square = _expected_softmax_square_sum(n, mult) / n
    out_std = math.sqrt(max(mean_square - 1.0 / n**2, 1e-12))
    output_scale, grad_scale = apply_constraint(
        constraint, 1 / out_std, 1 / (mult * mean_square**0.5))
    return _scaled_call(
        lambda x: F.softmax(x if mult == 1.0 else x * mult, dim=dim, dtype=dtype), (input,),
        output_scale, (grad_scale,),
    )


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Unit-scaled `F.dropout`.

    Rule: torch scales kept values by 1/(1-p), giving variance 1/(1-p); a further sqrt(1-p)
    makes the output and its gradient unit (the same factor both ways, so no constraint).
    """
    _reject("inplace", inplace, False, "the scaled output is a new tensor")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p={p!r} must be in [0, 1)")
    if not training or p == 0.0:
        return input
    # Dropout's backward uses its mask, not its output, so the fresh output can be scaled in place.
    return F.dropout(input, p, training).mul_(math.sqrt(1 - p))


# ---------------------------------------------------------------- normalisation and lookups


def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    """Unit-scaled `F.layer_norm`.

    Rule: the output is unit by construction and the input gradient is unit for unit input, so
    neither is scaled; weight and bias grad scale `batch_size**-0.5`, the number of rows their
    gradients sum over.
    """
    normalized_shape = tuple(normalized_shape)
    batch_size = max(1, input.numel() // max(1, math.prod(normalized_shape)))
    if fused.eager_forms():
        return fused.layer_norm(input, normalized_shape, weight, bias, eps, batch_size**-0.5)
    if weight is not None:
        weight = scale_bwd(weight, batch_size**-0.5)
    if bias is not None:
        bias = scale_bwd(bias, batch_size**-0.5)
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: Optional[int] = None,
    max_norm: Optional[float] = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """Unit-scaled `F.embedding`.

    Rule: the lookup of unit weights is unit; each weight row's gradient sums over the
    positions that look it up, on average lookups/num_embeddings of them, so the weight grad
    scale is sqrt(num_embeddings / lookups). `max_norm` renormalises the looked-up rows in
    place, as torch does (their scale is then the caller's choice).
    """
    _reject("scale_grad_by_freq", scale_grad_by_freq, False, "it replaces the unit grad scale")
    _reject("sparse", sparse, False, "sparse gradients are not scaled")
    lookups = max(1, input.numel())
    grad_scale = math.sqrt(weight.shape[0] / lookups)
    if max_norm is None and fused.eager_forms():
        return fused.embedding(input, weight, padding_idx, grad_scale)
    if max_norm is not None:
        # torch renormalises the weight in place, before the lookup records it.
        with torch.no_grad():
            torch.embedding_renorm_(weight, input, max_norm, norm_type)
    return F.embedding(input, scale_bwd(weight, grad_scale), padding_idx)


# ---------------------------------------------------------------- additions and residuals


def _broadcast_count(x: Tensor, out_numel: int) -> int:
    return max(1, out_numel // max(1, x.numel()))


def add(
    input: Union[Tensor, float],
    other: Union[Tensor, float],
    constraint: Union[ConstraintArg, float] = "to_output_scale",
    alpha: Union[float, ConstraintArg] = 1.0,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Unit-scaled `torch.add` (input + alpha * other).

    Rule: for independent unit inputs, output scale `1/sqrt(1 + alpha**2)`, grad scales 1
    (input) and 1/|alpha| (other), tied by `constraint`, which by default keeps the output unit
    (sums usually feed a network's input). A single value (a Python number, or a tensor of one
    element) is a constant, not a unit-variance tensor: it leaves the output's scale alone.
    An input broadcast across the output has its gradient summed over the copies; that sum is
    scaled by `copies**-0.5` on its own, outside the constraint, as for a weight.
    `add(input, other, alpha, constraint)` (alpha third, as earlier versions took it) is still
    understood.
    """
    rule: ConstraintArg
    if isinstance(constraint, (int, float)) and not isinstance(constraint, bool):
        # add(input, other, alpha[, constraint]), as earlier versions took it.
        rule = "to_output_scale" if isinstance(alpha, (int, float)) else alpha
        alpha = float(constraint)
    else:
        rule = constraint  # type: ignore[assignment]
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha={alpha!r} must be a number")
    alpha = float(alpha)
    _reject("out", out, None, "the scaled sum is a new tensor")
    if alpha == 0:
        raise ValueError("alpha=0 is not supported by the unit-scaled add: use the input itself")
    if not isinstance(input, Tensor) or not isinstance(other, Tensor):
        return torch.add(input, other, alpha=alpha)  # type: ignore[arg-type]
    if input.numel() == 1 and other.numel() != 1:
        output_scale = 1 / abs(alpha)
    elif other.numel() == 1 and input.numel() != 1:
        output_scale = 1.0
    else:
        output_scale = (1 + alpha**2) ** -0.5
    output_scale, input_scale, other_scale = apply_constraint(
        rule, output_scale, 1.0, 1 / abs(alpha)
    )
    out_numel = math.prod(torch.broadcast_shapes(input.shape, other.shape))
    input_scale *= _broadcast_count(input, out_numel) ** -0.5
    other_scale *= _broadcast_count(other, out_numel) ** -0.5
    return _scaled_call(
        lambda a, b: torch.add(a, b, alpha=alpha), (input, other), output_scale,
        (input_scale, other_scale), scale_in_place=True,
    )


def _residual_weights(tau: float) -> Tuple[float, float]:
    weights = _RESIDUAL_WEIGHTS.get(tau)
    if weights is None:
        if not 0 < tau < math.inf:
            raise ValueError(f"tau={tau!r} must be positive and finite")
        norm = math.hypot(1.0, tau)  # tau**2 would overflow above 1e154
        weights = tau / norm, 1 / norm
        if len(_RESIDUAL_WEIGHTS) < 1024:
            _RESIDUAL_WEIGHTS[tau] = weights
    return weights


_RESIDUAL_WEIGHTS: Dict[float, Tuple[float, float]] = {}


def residual_split(input: Tensor, tau: float = 1.0) -> Tuple[Tensor, Tensor]:
    """Split a residual stream into (residual-branch input, skip), for `residual_add`.

    With `a = tau / sqrt(1 + tau**2)`, `b = 1 / sqrt(1 + tau**2)`: the identity forward; in the
    backward the branch gradient is multiplied by a and the skip gradient by b, so the stream
    receives `a * g_branch + b * g_skip`, the true gradient of `a * f(x) + b * x`
    (`residual_add` applies a and b in the forward pass only). Both outputs' gradients stay unit.
    """
    branch_weight, skip_weight = _residual_weights(tau)
    if fused.eager_forms():
        return fused.residual_split(input, branch_weight, skip_weight)
    return scale_bwd(input, branch_weight), scale_bwd(input, skip_weight)


def residual_add(residual: Tensor, skip: Tensor, tau: float = 1.0) -> Tensor:
    """Join a residual branch back: `a * residual + b * skip`, unit variance for unit inputs.

    tau is the ratio of branch to skip weight. Both weights apply in the forward pass only, so
    the branch's own weights and activations, and the skip, receive unit gradients;
    `residual_split` applies them in the backward pass instead, where the gradients join the
    stream.
    """
    branch_weight, skip_weight = _residual_weights(tau)
    if residual.shape == skip.shape and residual.dtype == skip.dtype and fused.eager_forms():
        return fused.residual_add(residual, skip, branch_weight, skip_weight, 1.0)
    return scale_fwd(residual, branch_weight) + scale_fwd(skip, skip_weight)


def _residual_join(residual: Tensor, skip: Tensor, tau: float) -> Tensor:
    """`residual_add` whose skip weight applies in both passes: the join for a skip that is
    the stream itself, not `residual_split`'s skip output (as `unit_scale` builds residuals)."""
    branch_weight, skip_weight = _residual_weights(tau)
    if residual.shape == skip.shape and residual.dtype == skip.dtype and fused.eager_forms():
        return fused.residual_add(residual, skip, branch_weight, skip_weight, skip_weight)
    scaled_skip = skip * skip_weight
    scaled_residual = scale_fwd(residual, branch_weight)
    if scaled_skip.shape == scaled_residual.shape and scaled_skip.dtype == scaled_residual.dtype:
        # Accumulating into the fresh skip product saves an allocation; the sum is the same.
        return scaled_skip.add_(scaled_residual)
    return scaled_residual + scaled_skip  # broadcasting or type promotion: a new tensor


def residual_apply(fn: Callable[[Tensor], Tensor], input: Tensor, tau: float = 1.0) -> Tensor:
    """`residual_add(fn(branch), skip, tau)` for `(branch, skip) = residual_split(input, tau)`."""
    branch, skip = residual_split(input, tau)
    return residual_add(fn(branch), skip, tau)


# ---------------------------------------------------------------- attention


def _visible_keys(
    query_len: int, key_len: int, attn_mask: Optional[Tensor], is_causal: bool, device: torch.device
) -> Union[float, Tensor]:
    """How many keys each query row attends to (at least 1): a float, or a (..., rows, 1) tensor."""
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool:
            raise ValueError(
                "attn_mask must be a boolean mask for the unit-scaled attention: an additive "
                "float mask changes the softmax's scale by an amount it cannot know"
            )
        return attn_mask.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float32)
    if is_causal:
        rows = torch.arange(1, query_len + 1, device=device, dtype=torch.float32)
        return rows.clamp(min=1, max=max(1, key_len)).unsqueeze(-1)
    return float(max(1, key_len))


def _explicit_attention(
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


def _repeat_kv_heads(query: Tensor, key_or_value: Tensor) -> Tensor:
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
    """
    if scale is None:
        scale = _positive_mult(mult) / max(1, query.shape[-1])
    elif mult != 1.0:
        raise ValueError(f"mult={mult!r} and scale={scale!r}: give one of them, not both")
    if enable_gqa:
        key, value = _repeat_kv_heads(query, key), _repeat_kv_heads(query, value)
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
        out = _explicit_attention(query, key, value, attn_mask, dropout_p, is_causal)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    if attn_mask is None and fused.eager_forms():
        row_scale = _cached_row_scale(query.shape[-2], key.shape[-2], is_causal, logit_std,
                                      dropout_p, out.dtype, out.device)
    else:
        row_scale = _row_scale(query.shape[-2], key.shape[-2], attn_mask, is_causal, logit_std,
                               dropout_p, out.dtype, out.device)
    return out, row_scale


def _row_scale(query_len: int, key_len: int, attn_mask: Optional[Tensor], is_causal: bool,
               logit_std: float, dropout_p: float, dtype: torch.dtype,
               device: torch.device) -> Union[float, Tensor]:
    """sqrt((1 - dropout_p) / E[sum p**2]) for each query row: a float, or a (..., rows, 1)
    tensor."""
    visible = _visible_keys(query_len, key_len, attn_mask, is_causal, device)
    square_sum = _expected_softmax_square_sum(visible, logit_std, max(1, key_len))
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
        return (_expected_softmax_square_sum(float(n), logit_std) / keep) ** 0.5
    inverse_sum = sum(1.0 / _expected_softmax_square_sum(float(m), logit_std, n)
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


# ---------------------------------------------------------------- losses


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    size_average: Optional[bool] = None,
    ignore_index: int = -100,
    reduce: Optional[bool] = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled `F.cross_entropy`: the same loss value, a unit-scaled input gradient.

    Rule: for unit-normal logits over V classes, p - y has per-element variance
    (1 - 2/V + S(V)) / V, so each row's gradient is scaled by sqrt(V / (1 - 2/V + S(V))). With
    reduction="mean", torch divides by the number of counted targets, C (those not equal to
    `ignore_index`; all N rows for class-probability targets); the grad scale is then
    sqrt(C * N): the rows with a target get sqrt(N / C) each and the ignored rows zero, so the
    gradient has unit mean square over the whole (N, V) tensor, and so do the gradients of the
    layers below, whose scales count all N rows. In masked-LM training C is random (about 15%
    of the tokens, varying batch to batch); it is counted from `target` in the graph, a tensor
    that never leaves the device, so each batch gets its exact scale with no host read and no
    assumed masking rate. Without ignored targets C = N and the scale is N, as before.

    `mult` (u-μP's `loss_softmax_mult`) multiplies the logits in the forward pass only. Class
    `weight`s, `label_smoothing` and torch's deprecated `size_average` / `reduce` are refused.
    """
    _reject("size_average", size_average, None, "use reduction")
    _reject("reduce", reduce, None, "use reduction")
    _reject("label_smoothing", label_smoothing, 0.0, "the gradient scale assumes one-hot targets")
    return _cross_entropy(input, target, weight, ignore_index, reduction, 0.0, mult)


def _cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                   reduction: str, label_smoothing: float, mult: float = 1.0) -> Tensor:
    """`cross_entropy`, with a label smoothing if given (the one-hot rule's gradient scale,
    for `unit_scale`'s conversions of models that smooth their labels)."""
    _reject("weight", weight, None, "class weights change the gradient's scale per row")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be one of 'mean', 'sum', 'none'")
    classes = input.shape[1] if input.dim() > 1 else input.shape[0]
    per_element_var = (1 - 2 / classes + _expected_softmax_square_sum(classes)) / classes
    input = scale_bwd(input, per_element_var**-0.5)
    if mult != 1.0:
        input = scale_fwd(input, mult)
    loss = F.cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if reduction != "mean":
        return loss
    if target.is_floating_point():  # class probabilities: every row counts
        return scale_bwd(loss, max(1, input.numel() // max(1, classes)))
    rows = max(1, target.numel())
    if fused.eager_forms():  # the same scale in one node, counted in the backward pass
        return fused.scale_grad_by_count(loss, target != ignore_index, rows)
    counted = (target != ignore_index).sum().clamp(min=1).to(loss.dtype)
    return _scale_bwd_by_tensor(loss, torch.sqrt(counted * rows))


def _scale_bwd_by_tensor(x: Tensor, grad_scale: Tensor) -> Tensor:
    """Identity forward; the gradient is multiplied by the (device-side) tensor `grad_scale`.

    The same form as the traced `scale`, so it is right eagerly and under PopTorch alike; used
    on a scalar loss, its three extra ops cost nothing.
    """
    detached = x.detach()
    return detached + (x - detached) * grad_scale.detach()


def mse_loss(input: Tensor, target: Tensor, size_average: Optional[bool] = None,
             reduce: Optional[bool] = None, reduction: str = "mean") -> Tensor:
    """Unit-scaled `F.mse_loss`: the same loss value, unit-scaled gradients.

    Rule: the gradient is 2 (x - t) / N; for independent unit x and t, x - t has std sqrt(2), so
    both grad scales are N / (2 sqrt(2)) (without N for reduction="sum"/"none").
    """
    _reject("size_average", size_average, None, "use reduction")
    _reject("reduce", reduce, None, "use reduction")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be one of 'mean', 'sum', 'none'")
    if input.shape != target.shape:
        raise ValueError(f"input shape {tuple(input.shape)} != target shape {tuple(target.shape)}")
    elements = max(1, input.numel()) if reduction == "mean" else 1
    grad_scale = elements / (2 * math.sqrt(2))
    input, target = scale_bwd(input, grad_scale), scale_bwd(target, grad_scale)
    return F.mse_loss(input, target, reduction=reduction)

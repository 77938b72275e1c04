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
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_ops as fused
from . import rule_switch
from .scale_constraints import ConstraintArg, apply_constraint
from .scaling_primitive import scale, scale_bwd, scale_fwd
from .trace_switch import is_ipu_tracing

__all__ = [
    "linear",
    "linear_scales",
    "linear_readout",
    "conv1d",
    "matmul",
    "layer_norm",
    "embedding",
    "add",
    "residual_split",
    "residual_add",
    "residual_apply",
]


def scaled_call(
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


def reject_argument(name: str, value: object, default: object, why: str) -> None:
    """ValueError, giving `why`, when `value` (of argument `name`) is not its `default`."""
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
    three exponents 0.5 (`linear_readout` uses 1 for the output). The bias is added before the
    output scale, so that it moves the output at the pace the weight does: with Adam, a bias
    added at unit scale would move it `fan_in**0.5` times faster than one times the output
    scale, and trains worse (docs/results/nanogpt-demo).
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
            bias = scale(bias, output_scale, grad_weight_scale)
        return F.linear(input, weight, bias)
    # Under torch.compile and graph transforms: the matmul sees the unscaled input and weight
    # (what `transforms.simulate_fp8` casts); the compiler fuses the output's multiply.
    if bias is not None:
        bias = scale_bwd(bias, grad_weight_scale)
    return scale_fwd(F.linear(scale_bwd(input, grad_input_scale),
                              scale_bwd(weight, grad_weight_scale), bias), output_scale)


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
    the ends sum fewer products). `scale_power` replaces the three exponents 0.5. The bias is
    added before the output scale, as in `linear`.
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
    # As in `linear`'s PopTorch form: the output scale folded into the weight and the bias.
    weight = scale(weight, output_scale, grad_weight_scale)
    input = scale_bwd(input, grad_input_scale / output_scale)
    if bias is not None:
        bias = scale(bias, output_scale, grad_weight_scale)
    return F.conv1d(input, weight, bias, stride, padding, dilation, groups)


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
    right). All three tied by `constraint`. Under `rules("unit-scaling")` the counts are
    unit-scaling 0.3.5's: the right input's columns and the left input's rows (a broadcast batch
    is not counted).
    """
    out_numel = _matmul_output_numel(left.shape, right.shape)
    inner = max(1, left.shape[-1])
    left_count = max(1, out_numel * inner // max(1, left.numel()))
    right_count = max(1, out_numel * inner // max(1, right.numel()))
    if left.dim() >= 2 and right.dim() >= 2 and rule_switch.library_rules():
        left_count, right_count = rule_switch.matmul_grad_counts(left.shape, right.shape)
    output_scale, left_scale, right_scale = apply_constraint(
        constraint, inner**-0.5, left_count**-0.5, right_count**-0.5
    )
    if left.dim() >= 2 and right.dim() >= 2 and fused.eager_forms():
        return fused.matmul(left, right, output_scale, left_scale, right_scale)
    return scaled_call(
        torch.matmul, (left, right), output_scale, (left_scale, right_scale), scale_in_place=True
    )


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
    place, as torch does (their scale is then the caller's choice); under
    `rules("unit-scaling")` it renormalises the looked-up rows only, leaving the weight as it
    is, as unit-scaling 0.3.5 does.
    """
    reject_argument("scale_grad_by_freq", scale_grad_by_freq, False,
                    "it replaces the unit grad scale")
    reject_argument("sparse", sparse, False, "sparse gradients are not scaled")
    lookups = max(1, input.numel())
    grad_scale = math.sqrt(weight.shape[0] / lookups)
    if max_norm is None and fused.eager_forms():
        return fused.embedding(input, weight, padding_idx, grad_scale)
    if max_norm is not None and rule_switch.library_rules():
        # unit-scaling 0.3.5 renormalises a copy of the weight: the looked-up rows change, the
        # parameter does not.
        return F.embedding(input, scale_bwd(weight, grad_scale).clone(), padding_idx, max_norm,
                           norm_type)
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
    understood. Under `rules("unit-scaling")`, unit-scaling 0.3.5's rule: output scale 1/sqrt(2)
    (1 when either input is a single value), each gradient scale `copies**-0.5`, all three tied
    by the constraint; no alpha.
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
    reject_argument("out", out, None, "the scaled sum is a new tensor")
    if alpha == 0:
        raise ValueError("alpha=0 is not supported by the unit-scaled add: use the input itself")
    if not isinstance(input, Tensor) or not isinstance(other, Tensor):
        return torch.add(input, other, alpha=alpha)  # type: ignore[arg-type]
    if rule_switch.library_rules():
        return _library_add(input, other, rule, alpha)
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
    return scaled_call(
        lambda a, b: torch.add(a, b, alpha=alpha), (input, other), output_scale,
        (input_scale, other_scale), scale_in_place=True,
    )


def _library_add(input: Tensor, other: Tensor, rule: ConstraintArg, alpha: float) -> Tensor:
    """unit-scaling 0.3.5's add: the broadcast counts inside the constraint, a single value
    leaves the scale at 1, no alpha."""
    if alpha != 1.0:
        raise ValueError(f"alpha={alpha!r}: unit-scaling's add has no alpha "
                         "(rules('unit-scaling'))")
    out_numel = math.prod(torch.broadcast_shapes(input.shape, other.shape))
    output_scale, input_scale, other_scale = apply_constraint(rule, *rule_switch.add_scales(
        _broadcast_count(input, out_numel), _broadcast_count(other, out_numel),
        input.numel() == 1 or other.numel() == 1))
    return scale_fwd(torch.add(scale_bwd(input, input_scale), scale_bwd(other, other_scale)),
                     output_scale)


def residual_tau_weights(tau: float) -> Tuple[float, float]:
    """(branch, skip) weights of a residual join of ratio `tau`: `tau` and 1, normalised to a
    unit sum of squares."""
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
    branch_weight, skip_weight = residual_tau_weights(tau)
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
    branch_weight, skip_weight = residual_tau_weights(tau)
    if residual.shape == skip.shape and residual.dtype == skip.dtype and fused.eager_forms():
        return fused.residual_add(residual, skip, branch_weight, skip_weight, 1.0)
    return scale_fwd(residual, branch_weight) + scale_fwd(skip, skip_weight)


def residual_join(residual: Tensor, skip: Tensor, tau: float) -> Tensor:
    """`residual_add` whose skip weight applies in both passes: the join for a skip that is
    the stream itself, not `residual_split`'s skip output (as `unit_scale` builds residuals)."""
    branch_weight, skip_weight = residual_tau_weights(tau)
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

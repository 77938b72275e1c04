"""Constraints that tie forward and backward scales on edges that are not cut.

A unit-scaled op computes the ideal scale for its output and for the gradient of each input.
Where the input-to-output edge is not "cut" (the input is an activation, not a weight), the
forward and backward scales must be equal or the gradient would no longer be the gradient of the
forward function up to a global factor. A constraint chooses the shared value.

Every constraint takes `(output_scale, *grad_input_scales)` and returns the scales to use, in the
same order. `None` keeps them separate: each tensor is exactly unit, at the cost of a gradient
that is scaled differently from the forward pass (fine at a cut edge, or in a single-op test).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Tuple, Union

Scales = Tuple[float, ...]
Constraint = Callable[..., Scales]


def gmean(*scales: float) -> Scales:
    """Geometric mean: errs equally on both sides in log space (the paper's default)."""
    shared = math.exp(sum(math.log(s) for s in scales) / len(scales))
    return (shared,) * len(scales)


def hmean(*scales: float) -> Scales:
    """Harmonic mean: leans towards the smaller scale."""
    shared = len(scales) / sum(1.0 / s for s in scales)
    return (shared,) * len(scales)


def amean(*scales: float) -> Scales:
    """Arithmetic mean: leans towards the larger scale."""
    shared = sum(scales) / len(scales)
    return (shared,) * len(scales)


def to_output_scale(output_scale: float, *grad_input_scales: float) -> Scales:
    """Keep the output unit; gradients take the output's scale."""
    return (output_scale,) * (1 + len(grad_input_scales))


def to_grad_input_scale(output_scale: float, *grad_input_scales: float) -> Scales:
    """Keep the gradient of the first (left) input unit; the output and others take its scale."""
    if not grad_input_scales:
        raise ValueError("to_grad_input_scale needs at least one grad-input scale")
    return (grad_input_scales[0],) * (1 + len(grad_input_scales))


class SharedInputGmean:
    """`gmean` for one of several linears that read the same input (separate query, key and
    value projections; the gate and up projections of a gated MLP).

    The input's gradient is the sum of all their input gradients, so its ideal grad-input scale
    counts the outputs of them all, `total_fan_out**-0.5`, as one fused linear's would; each
    linear ties that to its output scale by the geometric mean. Each is then scaled the same way
    in both passes (the gradient stays the true one), and the input receives the gradient one
    fused linear would give it, (total_fan_out / fan_in)**0.25, instead of the sum of several
    (sqrt(3) for three equal projections).
    """

    def __init__(self, total_fan_out: int) -> None:
        if total_fan_out < 1:
            raise ValueError(f"total_fan_out={total_fan_out!r} must be positive")
        self.total_fan_out = total_fan_out

    def __call__(self, output_scale: float, grad_input_scale: float) -> Scales:
        return gmean(output_scale, self.total_fan_out**-0.5)

    def __repr__(self) -> str:
        return f"SharedInputGmean({self.total_fan_out})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SharedInputGmean) and other.total_fan_out == self.total_fan_out

    def __hash__(self) -> int:
        return hash(("SharedInputGmean", self.total_fan_out))


def unconstrained(*scales: float) -> Scales:
    return tuple(scales)


CONSTRAINTS: Dict[str, Constraint] = {
    "gmean": gmean,
    "hmean": hmean,
    "amean": amean,
    "to_output_scale": to_output_scale,
    "to_grad_input_scale": to_grad_input_scale,
}

ConstraintArg = Union[str, Constraint, None]


def get_constraint(constraint: ConstraintArg) -> Constraint:
    """Resolve a constraint given by name, as a callable, or `None` (separate scales)."""
    if constraint is None:
        return unconstrained
    if callable(constraint):
        return constraint
    if constraint in CONSTRAINTS:
        return CONSTRAINTS[constraint]
    raise ValueError(
        f"constraint={constraint!r} is not known; use one of {sorted(CONSTRAINTS)} or None"
    )


def apply_constraint(constraint: ConstraintArg, output_scale: float, *grad_scales: float) -> Scales:
    scales = get_constraint(constraint)(output_scale, *grad_scales)
    if len(scales) != 1 + len(grad_scales):
        raise ValueError("a constraint must return one scale per input scale")
    return tuple(float(s) for s in scales)


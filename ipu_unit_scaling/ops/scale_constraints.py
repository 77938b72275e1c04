"""Constraints that tie forward and backward scales on edges that are not cut.

A unit-scaled op computes the ideal scale for its output and for the gradient of each input.
Where the input-to-output edge is not "cut" (the input is an activation, not a weight), the
forward and backward scales must be equal or the gradient would no longer be the gradient of the
forward function up to a global factor. A constraint chooses the shared value.

Every constraint takes `(output_scale, *grad_input_scales)` and returns the one shared scale
(a float). `apply_constraint` gives it back once per scale, in the same order. `None` keeps
them separate: each tensor is exactly unit, at the cost of a gradient that is scaled
differently from the forward pass (fine at a cut edge, or in a single-op test).

Ops name their constraint by string (`"gmean"`, `"to_output_scale"`, ...) or pass a callable
of the same form; a callable may also return one scale per input scale (a tuple).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Sequence, Tuple, Union

Scales = Tuple[float, ...]
Constraint = Callable[..., Union[float, Sequence[float]]]

__all__ = [
    "gmean", "hmean", "amean", "to_output_scale", "to_grad_input_scale", "to_left_grad_scale",
    "to_right_grad_scale", "SharedInputGmean", "CONSTRAINTS", "get_constraint",
    "apply_constraint",
]


def gmean(*scales: float) -> float:
    """Geometric mean: errs equally on both sides in log space (the paper's default)."""
    return math.exp(sum(math.log(s) for s in scales) / len(scales))


def hmean(*scales: float) -> float:
    """Harmonic mean: leans towards the smaller scale (Xavier/Glorot's choice)."""
    return len(scales) / sum(1.0 / s for s in scales)


def amean(*scales: float) -> float:
    """Arithmetic mean: leans towards the larger scale."""
    return sum(scales) / len(scales)


def to_output_scale(output_scale: float, *grad_input_scales: float) -> float:
    """Keep the output unit; gradients take the output's scale."""
    return output_scale


def to_grad_input_scale(output_scale: float, grad_input_scale: float,
                        *other_grad_input_scales: float) -> float:
    """Keep the gradient of the (first) input unit; the output takes its scale."""
    return grad_input_scale


def to_left_grad_scale(output_scale: float, left_grad_scale: float,
                       right_grad_scale: float) -> float:
    """For a product of two inputs: keep the left input's gradient unit."""
    return left_grad_scale


def to_right_grad_scale(output_scale: float, left_grad_scale: float,
                        right_grad_scale: float) -> float:
    """For a product of two inputs: keep the right input's gradient unit."""
    return right_grad_scale


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

    def __call__(self, output_scale: float, grad_input_scale: float) -> float:
        return gmean(output_scale, self.total_fan_out**-0.5)

    def __repr__(self) -> str:
        return f"SharedInputGmean({self.total_fan_out})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SharedInputGmean) and other.total_fan_out == self.total_fan_out

    def __hash__(self) -> int:
        return hash(("SharedInputGmean", self.total_fan_out))


CONSTRAINTS: Dict[str, Constraint] = {
    "gmean": gmean,
    "hmean": hmean,
    "amean": amean,
    "to_output_scale": to_output_scale,
    "to_grad_input_scale": to_grad_input_scale,
    "to_left_grad_scale": to_left_grad_scale,
    "to_right_grad_scale": to_right_grad_scale,
}

ConstraintArg = Union[str, Constraint, None]


def get_constraint(constraint: ConstraintArg) -> Constraint:
    """Resolve a constraint given by name or as a callable; ValueError for an unknown name.

    `None` (or `""`) means no constraint: every scale is kept as it is.
    """
    if constraint is None or constraint == "":
        return _unconstrained
    if callable(constraint):
        return constraint
    if constraint in CONSTRAINTS:
        return CONSTRAINTS[constraint]
    raise ValueError(
        f"constraint={constraint!r} is not known; use one of {sorted(CONSTRAINTS)} or None"
    )


def _unconstrained(*scales: float) -> Scales:
    return tuple(scales)


def apply_constraint(constraint: ConstraintArg, *scales: float) -> Scales:
    """The scales `(output_scale, *grad_input_scales)` after `constraint`, one per scale."""
    shared = get_constraint(constraint)(*scales)
    if isinstance(shared, (int, float)):
        return (float(shared),) * len(scales)
    shared = tuple(float(s) for s in shared)
    if len(shared) != len(scales):
        raise ValueError("a constraint must return one scale, or one per input scale")
    return shared

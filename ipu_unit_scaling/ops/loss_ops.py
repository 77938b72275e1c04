"""Unit-scaled losses: cross entropy and mean squared error, whose gradients (not outputs) are
unit-scaled."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused_ops as fused
from . import rule_switch
from .activation_ops import expected_softmax_square_sum
from .scaling_primitive import scale_bwd, scale_fwd
from .unit_ops import reject_argument

__all__ = [
    "cross_entropy",
    "mse_loss",
]


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

    Under `rules("unit-scaling")`, unit-scaling 0.3.5's rule: the input gradient scaled by
    `V / sqrt(V - 1)` (for a uniform softmax), and with reduction="mean" the summed loss divided
    by the number of rows, ignored ones included, in the forward pass only.
    """
    reject_argument("size_average", size_average, None, "use reduction")
    reject_argument("reduce", reduce, None, "use reduction")
    reject_argument("label_smoothing", label_smoothing, 0.0,
                    "the gradient scale assumes one-hot targets")
    return smoothed_cross_entropy(input, target, weight, ignore_index, reduction, 0.0, mult)


def smoothed_cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor],
                           ignore_index: int, reduction: str, label_smoothing: float,
                           mult: float = 1.0) -> Tensor:
    """`cross_entropy`, with a label smoothing if given (the one-hot rule's gradient scale,
    for `unit_scale`'s conversions of models that smooth their labels)."""
    reject_argument("weight", weight, None, "class weights change the gradient's scale per row")
    if rule_switch.library_rules():
        return _library_cross_entropy(input, target, ignore_index, reduction, label_smoothing,
                                      mult)
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be one of 'mean', 'sum', 'none'")
    classes = input.shape[1] if input.dim() > 1 else input.shape[0]
    per_element_var = (1 - 2 / classes + expected_softmax_square_sum(classes)) / classes
    grad_scale = per_element_var**-0.5
    if reduction == "mean" and target.is_floating_point():  # class probabilities: all rows
        grad_scale *= max(1, input.numel() // max(1, classes))
    # The backward scales go on the input, before the loss op: PopTorch differentiates from
    # the graph's last loss op, so a scale on the loss's own output would not reach a gradient.
    input = scale_bwd(input, grad_scale)
    if mult != 1.0:
        input = scale_fwd(input, mult)
    counting = reduction == "mean" and not target.is_floating_point()
    rows = max(1, target.numel())
    if counting and not fused.eager_forms():
        counted = (target != ignore_index).sum().clamp(min=1).to(input.dtype)
        input = _scale_bwd_by_tensor(input, torch.sqrt(counted * rows))
    loss = F.cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if counting and fused.eager_forms():  # the same scale in one node, counted in backward
        return fused.scale_grad_by_count(loss, target != ignore_index, rows)
    return loss


def _library_cross_entropy(input: Tensor, target: Tensor, ignore_index: int, reduction: str,
                           label_smoothing: float, mult: float) -> Tensor:
    """unit-scaling 0.3.5's cross entropy: input gradient scale `V / sqrt(V - 1)` for V
    classes, the summed loss divided by the number of rows for "mean" (ignored targets counted
    among the rows), and that division in the forward pass only. Inputs of more than two
    dimensions (the library takes one or two) have their classes in dimension 1, as in torch.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be one of 'mean', 'sum', 'none'")
    classes = input.shape[1] if input.dim() > 1 else input.shape[0]
    rows = max(1, input.numel() // max(1, classes))
    input = scale_fwd(scale_bwd(input, rule_switch.cross_entropy_grad_scale(classes)), mult)
    loss = F.cross_entropy(input, target, ignore_index=ignore_index,
                           reduction="sum" if reduction == "mean" else reduction,
                           label_smoothing=label_smoothing)
    return scale_fwd(loss, 1 / rows) if reduction == "mean" else loss


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
    reject_argument("size_average", size_average, None, "use reduction")
    reject_argument("reduce", reduce, None, "use reduction")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be one of 'mean', 'sum', 'none'")
    if input.shape != target.shape:
        raise ValueError(f"input shape {tuple(input.shape)} != target shape {tuple(target.shape)}")
    elements = max(1, input.numel()) if reduction == "mean" else 1
    grad_scale = elements / (2 * math.sqrt(2))
    input, target = scale_bwd(input, grad_scale), scale_bwd(target, grad_scale)
    return F.mse_loss(input, target, reduction=reduction)

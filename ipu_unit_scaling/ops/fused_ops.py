"""The eager forms of the unit-scaled ops that sit on a training step's hot path.

Each op is one autograd Function whose fixed scales ride along with work the op does anyway:
a GEMM takes its scale as ``alpha`` (``addmm``), a fresh output is scaled in
place, a gradient is scaled where it is produced. Built from ``scale()`` instead, the same op
costs a scaled copy of the weight, a node per scale and an elementwise pass per multiply.

These forms are for eager PyTorch only: PopTorch drops custom backwards, so
:mod:`ipu_unit_scaling.functional` uses the ``scale()`` composition under
:func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing` and these Functions everywhere else.

Values and gradients are those of the composition up to float32 rounding: a scale applied
inside a GEMM, or to the product instead of the weight, rounds differently in the last bit.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .trace_switch import is_ipu_tracing

__all__ = [
    "eager_forms", "cached_scales", "applier", "scaled_mm", "linear", "matmul", "gelu",
    "layer_norm", "embedding", "residual_split", "residual_add", "scale_grad_by_count",
    "addmm_zero", "linear_forward", "linear_backward",
]

def _never() -> bool:
    return False


# Whether torch.compile is tracing the call (torch 2.1 on; torch 2.0 never says so). Looked up
# once: it is asked at every eager op.
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _never)


def eager_forms() -> bool:
    """Whether the ops take these forms: not under ipu_tracing() (PopTorch drops custom
    backwards; see :mod:`ipu_unit_scaling.ops.trace_switch`) and not while torch.compile traces (it
    gets the ``scale()`` composition, which it fuses itself)."""
    return not is_ipu_tracing() and not _compiling()


# Scales by (op, shape sizes, constraint name): at small widths the Python that derives them
# is a visible share of a step. Named constraints only (a callable could depend on state);
# eager only (under torch.compile the cache would be guarded on).
_SCALES: Dict[tuple, Tuple[float, ...]] = {}


def cached_scales(key: tuple, compute: Callable[..., Tuple[float, ...]],
                  *args: Any) -> Tuple[float, ...]:
    """``compute(*args)``, remembered under ``key`` when its last entry (the constraint) is a
    name or None."""
    scales = _SCALES.get(key)
    if scales is None:
        scales = compute(*args)
        if isinstance(key[-1], str) or key[-1] is None:
            if len(_SCALES) >= 4096:
                _SCALES.clear()
            _SCALES[key] = scales
    return scales


def applier(function: Any) -> Callable[..., Any]:
    """``function.apply`` without its Python wrapper, whose work (unwrapping functorch's dead
    wrappers) is a no-op outside functorch transforms yet costs microseconds per call; under
    a transform the wrapper runs as usual."""
    base = getattr(torch._C, "_FunctionBase", None)
    raw = getattr(base, "__dict__", {}).get("apply")
    transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if raw is None or transforms_active is None:
        return function.apply
    direct = raw.__get__(None, function)

    def apply(*args: Any) -> Any:
        return function.apply(*args) if transforms_active() else direct(*args)

    return apply


_ZEROS: Dict[torch.dtype, Tensor] = {}


def addmm_zero(like: Tensor) -> Tensor:
    """A 0-d zero for ``addmm(..., beta=0)``, which ignores it (no copy, no NaN passed on)."""
    if not like.is_cpu:
        return like.new_zeros(())
    zero = _ZEROS.get(like.dtype)
    if zero is None:
        zero = _ZEROS[like.dtype] = torch.zeros((), dtype=like.dtype)
    return zero


def scaled_mm(a: Tensor, b: Tensor, alpha: float) -> Tensor:
    """``alpha * (a @ b)``: the scale goes into the GEMM where there is one (2-D), else into
    the fresh product in place.

    Not ``baddbmm(..., beta=0)`` for 3-D: torch 2.0's small-matrix CPU kernel multiplies its
    uninitialised output by beta, so garbage NaNs leak into the result now and then.
    """
    if a.dim() == 2 and b.dim() == 2:
        return torch.addmm(addmm_zero(a), a, b, beta=0, alpha=alpha)
    return torch.matmul(a, b).mul_(alpha)


class _Linear(torch.autograd.Function):
    """``output_scale * (x @ weight.T + bias)`` for non-empty ``x`` of at least two dimensions
    and a non-empty weight; gradients: input ``grad_input_scale * g @ weight``, weight
    ``grad_weight_scale * g.T @ x``, bias ``grad_weight_scale * sum(g)``.

    With ``row_scale`` (a float, or a tensor that broadcasts over the output), the output is
    then multiplied by it in place, and the incoming gradient by it first: the same products
    as a ``* row_scale`` after the Function, without its autograd node and its copy of the
    output (the attention row scale after the output projection, `uu.SelfAttention`).

    Kept lean: at small widths the Python around the GEMMs is a visible share of a step.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], output_scale: float,
                grad_input_scale: float, grad_weight_scale: float,
                row_scale: Union[None, float, Tensor] = None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.scales = (grad_input_scale, grad_weight_scale, bias is not None, row_scale)
        out = linear_forward(x, weight, bias, output_scale)
        return out if row_scale is None else out.mul_(row_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad_input_scale, grad_weight_scale, has_bias, row_scale = ctx.scales
        needs = ctx.needs_input_grad
        grad_x, grad_w, grad_b = linear_backward(
            grad, x, weight, grad_input_scale, grad_weight_scale, row_scale, needs[0], needs[1],
            has_bias and needs[2])
        return grad_x, grad_w, grad_b, None, None, None, None


def linear_backward(grad: Tensor, x: Tensor, weight: Tensor, grad_input_scale: float,
                    grad_weight_scale: float, row_scale: Union[None, float, Tensor],
                    need_input: bool, need_weight: bool, need_bias: bool,
                    weight_grad: Optional[Tensor] = None
                    ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """The gradients (input, weight, bias) of :class:`_Linear`, each only where asked; for the
    Functions of `fused_blocks` that end or start with a linear. ``weight_grad``: the output
    gradient as the weight's gradient GEMM reads it, where it differs from ``grad`` (an FP8
    cast along its other dimension; then ``row_scale`` is None)."""
    if row_scale is not None:
        grad = grad * row_scale
    grad_rows = grad.reshape(-1, grad.shape[-1])
    zero = addmm_zero(grad)
    grad_x = grad_w = grad_b = None
    if need_input:
        grad_x = torch.addmm(zero, grad_rows, weight, beta=0,
                             alpha=grad_input_scale).view_as(x)
    if need_weight:
        weight_rows = grad_rows if weight_grad is None else weight_grad
        grad_w = torch.addmm(zero, weight_rows.t(), x.reshape(-1, x.shape[-1]), beta=0,
                             alpha=grad_weight_scale)
    if need_bias:
        grad_b = grad_rows.sum(0).mul_(grad_weight_scale)
    return grad_x, grad_w, grad_b


_linear_apply = applier(_Linear)

def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor],
                    output_scale: float) -> Tensor:
    if bias is None:
        out = torch.addmm(addmm_zero(x), x.reshape(-1, x.shape[-1]), weight.t(), beta=0,
                          alpha=output_scale)
    else:
        out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t(), beta=output_scale,
                          alpha=output_scale)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], output_scale: float,
           grad_input_scale: float, grad_weight_scale: float,
           row_scale: Union[None, float, Tensor] = None) -> Tensor:
    """The unit-scaled linear with its three scales, its output then times ``row_scale`` if
    given (see :class:`_Linear`)."""
    if x.dim() < 2 or not x.numel() or not weight.numel():
        # Shapes the GEMM form does not take (a vector; empty tensors, which reshape(-1, 0)
        # cannot flatten): torch's linear, scaled like the PopTorch form.
        out = _composed_linear(x, weight, bias, output_scale, grad_input_scale,
                               grad_weight_scale)
        return out if row_scale is None else out * row_scale
    if not torch.is_grad_enabled():
        out = linear_forward(x, weight, bias, output_scale)
        return out if row_scale is None else out.mul_(row_scale)
    return _linear_apply(x, weight, bias, output_scale, grad_input_scale, grad_weight_scale,
                         row_scale)


def _composed_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], output_scale: float,
                     grad_input_scale: float, grad_weight_scale: float) -> Tensor:
    from .scaling_primitive import scale, scale_bwd

    weight = scale(weight, output_scale, grad_weight_scale)
    x = scale_bwd(x, grad_input_scale / output_scale)
    if bias is not None:
        bias = scale(bias, output_scale, grad_weight_scale)
    return F.linear(x, weight, bias)


def _sum_to(grad: Tensor, like: Tensor) -> Tensor:
    return grad if grad.shape == like.shape else grad.sum_to_size(like.shape)


class _Matmul(torch.autograd.Function):
    """``output_scale * left @ right`` (both at least 2-D); each input's gradient scaled by its
    own factor."""

    @staticmethod
    def forward(ctx: Any, left: Tensor, right: Tensor, output_scale: float, left_scale: float,
                right_scale: float) -> Tensor:
        ctx.save_for_backward(left, right)
        ctx.scales = (left_scale, right_scale)
        return scaled_mm(left, right, output_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        left, right = ctx.saved_tensors
        left_scale, right_scale = ctx.scales
        grad_left = grad_right = None
        if ctx.needs_input_grad[0]:
            grad_left = _sum_to(scaled_mm(grad, right.transpose(-1, -2), left_scale), left)
        if ctx.needs_input_grad[1]:
            grad_right = _sum_to(scaled_mm(left.transpose(-1, -2), grad, right_scale), right)
        return grad_left, grad_right, None, None, None


_matmul_apply = applier(_Matmul)

def matmul(left: Tensor, right: Tensor, output_scale: float, left_scale: float,
           right_scale: float) -> Tensor:
    """The unit-scaled matmul of two operands with at least two dimensions each."""
    return _matmul_apply(left, right, output_scale, left_scale, right_scale)


class _Gelu(torch.autograd.Function):
    """``output_scale * gelu(x)``; the gradient ``grad_scale * gelu'(x) * g``, rounded as the
    ``scale()`` composition rounds it (times the output scale, GELU's backward, times the
    ratio), so that the eager and PopTorch forms agree to the last bit here."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, approximate: str, output_scale: float,
                grad_scale: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.scales = (approximate, output_scale, grad_scale / output_scale)
        return F.gelu(x, approximate=approximate).mul_(output_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        (x,) = ctx.saved_tensors
        approximate, output_scale, ratio = ctx.scales
        grad_x = torch.ops.aten.gelu_backward(grad * output_scale, x, approximate=approximate)
        return grad_x.mul_(ratio), None, None, None


_gelu_apply = applier(_Gelu)

def gelu(x: Tensor, approximate: str, output_scale: float, grad_scale: float) -> Tensor:
    return _gelu_apply(x, approximate, output_scale, grad_scale)


class _LayerNorm(torch.autograd.Function):
    """``F.layer_norm`` whose weight and bias gradients are multiplied by ``param_grad_scale``;
    the same kernels as torch's own node, so values and gradients are torch's bit for bit."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, normalized_shape: Tuple[int, ...], weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float, param_grad_scale: float) -> Tensor:
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        ctx.normalized_shape, ctx.param_grad_scale = normalized_shape, param_grad_scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        wants = ctx.needs_input_grad
        mask = [wants[0], weight is not None and wants[2], bias is not None and wants[3]]
        grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
            grad.contiguous(), x, ctx.normalized_shape, mean, rstd, weight, bias, mask)
        scale = ctx.param_grad_scale
        grad_w = grad_w.mul_(scale) if grad_w is not None else None
        grad_b = grad_b.mul_(scale) if grad_b is not None else None
        return grad_x, None, grad_w, grad_b, None, None


_layernorm_apply = applier(_LayerNorm)

def layer_norm(x: Tensor, normalized_shape: Tuple[int, ...], weight: Optional[Tensor],
               bias: Optional[Tensor], eps: float, param_grad_scale: float) -> Tensor:
    return _layernorm_apply(x, normalized_shape, weight, bias, eps, param_grad_scale)


class _Embedding(torch.autograd.Function):
    """``F.embedding`` whose weight gradient is multiplied by ``grad_scale``."""

    @staticmethod
    def forward(ctx: Any, indices: Tensor, weight: Tensor, padding_idx: Optional[int],
                grad_scale: float) -> Tensor:
        ctx.save_for_backward(indices)
        ctx.rows, ctx.grad_scale = weight.shape[0], grad_scale
        ctx.padding_idx = -1 if padding_idx is None else padding_idx
        return F.embedding(indices, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        (indices,) = ctx.saved_tensors
        grad_w = torch.ops.aten.embedding_backward(
            grad, indices, ctx.rows, ctx.padding_idx, False, False)
        return None, grad_w.mul_(ctx.grad_scale), None, None


_embedding_apply = applier(_Embedding)

def embedding(indices: Tensor, weight: Tensor, padding_idx: Optional[int],
              grad_scale: float) -> Tensor:
    return _embedding_apply(indices, weight, padding_idx, grad_scale)


class _ResidualSplit(torch.autograd.Function):
    """(branch, skip), both ``x``; the gradient ``skip_weight * g_skip + branch_weight *
    g_branch`` in one pass, the sum autograd would otherwise form after scaling each apart."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, branch_weight: float,
                skip_weight: float) -> Tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        ctx.weights = (branch_weight, skip_weight)
        return x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad_branch: Optional[Tensor],
                 grad_skip: Optional[Tensor]) -> Tuple[Optional[Tensor], None, None]:
        branch_weight, skip_weight = ctx.weights
        if grad_branch is None:
            return (None if grad_skip is None else grad_skip * skip_weight), None, None
        if grad_skip is None:
            return grad_branch * branch_weight, None, None
        return torch.mul(grad_skip, skip_weight).add_(grad_branch, alpha=branch_weight), None, None


_residualsplit_apply = applier(_ResidualSplit)

def residual_split(x: Tensor, branch_weight: float, skip_weight: float) -> Tuple[Tensor, Tensor]:
    return _residualsplit_apply(x, branch_weight, skip_weight)


class _ResidualAdd(torch.autograd.Function):
    """``branch_weight * residual + skip_weight * skip`` (same shapes and dtypes); the gradient
    reaches the residual unscaled and the skip multiplied by ``skip_grad_weight``."""

    @staticmethod
    def forward(ctx: Any, residual: Tensor, skip: Tensor, branch_weight: float,
                skip_weight: float, skip_grad_weight: float) -> Tensor:
        ctx.skip_grad_weight = skip_grad_weight
        return torch.mul(skip, skip_weight).add_(residual, alpha=branch_weight)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        skip_grad = grad if ctx.skip_grad_weight == 1.0 else grad * ctx.skip_grad_weight
        return grad, skip_grad, None, None, None


_residualadd_apply = applier(_ResidualAdd)

def residual_add(residual: Tensor, skip: Tensor, branch_weight: float, skip_weight: float,
                 skip_grad_weight: float) -> Tensor:
    return _residualadd_apply(residual, skip, branch_weight, skip_weight, skip_grad_weight)


class _ScaleGradByCount(torch.autograd.Function):
    """The identity on a scalar loss; its gradient times ``sqrt(max(1, counted) * rows)``,
    where ``counted`` sums ``mask`` (the targets a mean loss averaged over)."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, mask: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(mask)
        ctx.rows = rows
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        (mask,) = ctx.saved_tensors
        counted = mask.sum().clamp_(min=1).to(grad.dtype)
        return grad * torch.sqrt(counted * ctx.rows), None, None


_scale_grad_by_count_apply = applier(_ScaleGradByCount)


def scale_grad_by_count(loss: Tensor, mask: Tensor, rows: int) -> Tensor:
    """A mean loss's gradient scale ``sqrt(counted * rows)`` in one node (see
    :class:`_ScaleGradByCount`); the count stays a tensor, never read on the host."""
    return _scale_grad_by_count_apply(loss, mask, rows)

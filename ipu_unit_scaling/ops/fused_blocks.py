"""Eager forms of whole pieces of a unit-scaled transformer layer, one autograd Function each.

At small widths a training step on a CPU is dominated by per-op overhead, and a unit-scaled op
built as a Python autograd Function costs more of it than torch's own C++ nodes. So that unit
scaling costs no more than the plain model, `uu.TransformerBlock` and `uu.FeedForward` compute these
pieces in one Function each, with every fixed scale folded into a GEMM or into a pass the plain
model makes anyway:

- :func:`residual_norm`: the residual join of the previous branch (``a * f + b * x``, where
  there is one), the split of the stream into branch and skip, and the branch's layer norm;
- :func:`mlp`: linear, GELU, linear, with GELU's scales folded into the second GEMM;
- :func:`embed`: token and position lookups and their unit-scaled sum.

Values and gradients are those of the ops composed one by one (`U.residual_add`,
`U.residual_split`, `U.layer_norm`, `U.linear`, `U.gelu`) up to float32 rounding. The modules
take these forms only in eager mode, when nothing observes their submodules (no hooks, no
torch function mode) and their parts are the unit-scaled ones; see `modules.py`.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .fused_ops import _zero, applier

__all__ = ["residual_norm", "mlp", "embed"]

_layer_norm_backward = torch.ops.aten.native_layer_norm_backward
_gelu_backward = torch.ops.aten.gelu_backward


class _ResidualNorm(torch.autograd.Function):
    """(layer_norm(h), h) with h = ``x`` or ``skip_weight * x + branch_weight * f``.

    h is the stream: the next skip. The norm's input is the next branch; their gradients join
    the stream multiplied by ``next_branch_weight`` and ``next_skip_weight`` (unit scaling's
    residual split); ``f`` and ``x`` receive the stream's gradient unscaled (the join weighs
    them in the forward pass only).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, f: Optional[Tensor], branch_weight: float,
                skip_weight: float, next_branch_weight: float, next_skip_weight: float,
                weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                param_grad_scale: float) -> Tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        if f is None:
            stream = x.view_as(x)
        else:
            stream = torch.mul(x, skip_weight).add_(f, alpha=branch_weight)
        shape = (x.shape[-1],)
        normed, mean, rstd = torch.native_layer_norm(stream, shape, weight, bias, eps)
        ctx.save_for_backward(stream, mean, rstd, weight, bias)
        ctx.scales = (f is not None, next_branch_weight, next_skip_weight, param_grad_scale)
        return normed, stream

    @staticmethod
    def backward(ctx: Any, grad_normed: Optional[Tensor],
                 grad_stream: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        stream, mean, rstd, weight, bias = ctx.saved_tensors
        joined, next_branch_weight, next_skip_weight, param_grad_scale = ctx.scales
        needs = ctx.needs_input_grad
        grad_w = grad_b = None
        if grad_stream is not None and next_skip_weight != 1.0:
            grad_stream = grad_stream * next_skip_weight
        if grad_normed is not None:
            mask = [True, weight is not None and needs[6], bias is not None and needs[7]]
            grad_branch, grad_w, grad_b = _layer_norm_backward(
                grad_normed.contiguous(), stream, (stream.shape[-1],), mean, rstd, weight, bias,
                mask)
            if grad_w is not None:
                grad_w = grad_w.mul_(param_grad_scale)
            if grad_b is not None:
                grad_b = grad_b.mul_(param_grad_scale)
            if grad_stream is None:  # (a weight of 1, as before a final norm: no pass)
                grad_stream = (grad_branch if next_branch_weight == 1.0
                               else grad_branch.mul_(next_branch_weight))
            else:
                grad_stream = torch.add(grad_stream, grad_branch, alpha=next_branch_weight)
            # Python holds a local until the function returns; autograd's own nodes free a
            # gradient once used. Let go of it here, or the step's peak memory grows.
            del grad_branch
        if not joined:
            return grad_stream, None, None, None, None, None, grad_w, grad_b, None, None
        return grad_stream, grad_stream, None, None, None, None, grad_w, grad_b, None, None


_residualnorm_apply = applier(_ResidualNorm)

def residual_norm(x: Tensor, f: Optional[Tensor], branch_weight: float, skip_weight: float,
                  next_branch_weight: float, next_skip_weight: float, weight: Optional[Tensor],
                  bias: Optional[Tensor], eps: float,
                  param_grad_scale: float) -> Tuple[Tensor, Tensor]:
    """(the next branch's normalised input, the stream) after joining ``f`` into ``x`` (if
    given); see :class:`_ResidualNorm`."""
    return _residualnorm_apply(x, f, branch_weight, skip_weight, next_branch_weight,
                               next_skip_weight, weight, bias, eps, param_grad_scale)


class _MLP(torch.autograd.Function):
    """``down(gelu(up(x)))`` with unit scaling's scales, GELU's folded into the down GEMMs.

    ``scales``: (up output, up grad input, up grad weight, gelu output, gelu grad, down
    output, down grad input, down grad weight).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, up_weight: Tensor, up_bias: Optional[Tensor],
                down_weight: Tensor, down_bias: Optional[Tensor], approximate: str,
                scales: Tuple[float, ...]) -> Tensor:
        up_out, _, _, gelu_out, _, down_out, _, _ = scales
        rows = x.reshape(-1, x.shape[-1])
        hidden = torch.addmm(_zero(rows) if up_bias is None else up_bias, rows, up_weight.t(),
                             beta=0 if up_bias is None else 1, alpha=up_out)
        activated = F.gelu(hidden, approximate=approximate)
        out = torch.addmm(_zero(rows) if down_bias is None else down_bias, activated,
                          down_weight.t(), beta=0 if down_bias is None else 1,
                          alpha=down_out * gelu_out)
        ctx.save_for_backward(rows, up_weight, up_bias, down_weight)
        # The intermediates are kept on ctx, not saved: the backward pass drops each once used,
        # as torch's per-op nodes would (held to the end, they would raise the peak memory).
        ctx.intermediates = (hidden, activated)
        ctx.meta = (x.shape, approximate, scales, up_bias is not None, down_bias is not None)
        return out.view(*x.shape[:-1], down_weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        rows, up_weight, up_bias, down_weight = ctx.saved_tensors
        x_shape, approximate, scales, has_up_bias, has_down_bias = ctx.meta
        up_out, up_grad_in, up_grad_w, gelu_out, gelu_grad, _, down_grad_in, down_grad_w = scales
        if ctx.intermediates is None:  # a second backward (retain_graph=True): recompute them
            hidden = torch.addmm(_zero(rows) if up_bias is None else up_bias, rows,
                                 up_weight.t(), beta=0 if up_bias is None else 1, alpha=up_out)
            activated = F.gelu(hidden, approximate=approximate)
        else:
            hidden, activated = ctx.intermediates
            ctx.intermediates = None
        needs = ctx.needs_input_grad
        grad_rows = grad.reshape(-1, grad.shape[-1])
        zero = _zero(grad_rows)
        grad_down_w = grad_down_b = grad_up_w = grad_up_b = grad_x = None
        if needs[3]:
            grad_down_w = torch.addmm(zero, grad_rows.t(), activated, beta=0,
                                      alpha=down_grad_w * gelu_out)
        del activated
        if has_down_bias and needs[4]:
            grad_down_b = grad_rows.sum(0).mul_(down_grad_w)
        if needs[0] or needs[1] or needs[2]:
            grad_activated = torch.addmm(zero, grad_rows, down_weight, beta=0,
                                         alpha=down_grad_in * gelu_grad)
            grad_hidden = _gelu_backward(grad_activated, hidden, approximate=approximate)
            # Freed once used, as autograd frees a node's gradient (peak memory).
            del grad_activated, hidden
            if needs[0]:
                grad_x = torch.addmm(zero, grad_hidden, up_weight, beta=0,
                                     alpha=up_grad_in).view(x_shape)
            if needs[1]:
                grad_up_w = torch.addmm(zero, grad_hidden.t(), rows, beta=0, alpha=up_grad_w)
            if has_up_bias and needs[2]:
                grad_up_b = grad_hidden.sum(0).mul_(up_grad_w)
        return grad_x, grad_up_w, grad_up_b, grad_down_w, grad_down_b, None, None


_mlp_apply = applier(_MLP)

def mlp(x: Tensor, up_weight: Tensor, up_bias: Optional[Tensor], down_weight: Tensor,
        down_bias: Optional[Tensor], approximate: str, scales: Tuple[float, ...]) -> Tensor:
    """The unit-scaled MLP block in one Function (see :class:`_MLP`); ``x`` non-empty, at
    least 2-D."""
    return _mlp_apply(x, up_weight, up_bias, down_weight, down_bias, approximate, scales)


class _Embed(torch.autograd.Function):
    """``output_scale * (token_weight[ids] + position_weight[:seq])`` for ``ids`` of shape
    (batch, seq); the token weight's gradient scaled by ``token_grad_scale`` and the position
    weight's (a sum over the batch) by ``position_grad_scale``."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, token_weight: Tensor, position_weight: Tensor,
                output_scale: float, token_grad_scale: float,
                position_grad_scale: float) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.meta = (token_weight.shape[0], position_weight.shape, token_grad_scale,
                    position_grad_scale)
        out = F.embedding(ids, token_weight)
        return out.add_(position_weight[:ids.shape[-1]]).mul_(output_scale)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        (ids,) = ctx.saved_tensors
        rows, position_shape, token_grad_scale, position_grad_scale = ctx.meta
        grad_token = grad_position = None
        if ctx.needs_input_grad[1]:
            grad_token = _embedding_backward(grad, ids, rows, -1, False, False)
            grad_token = grad_token.mul_(token_grad_scale)
        if ctx.needs_input_grad[2]:
            grad_position = grad.new_zeros(position_shape)
            torch.sum(grad, 0, out=grad_position[:ids.shape[-1]])
            grad_position = grad_position.mul_(position_grad_scale)
        return None, grad_token, grad_position, None, None, None


_embed_apply = applier(_Embed)
_embedding_backward = torch.ops.aten.embedding_backward


def embed(ids: Tensor, token_weight: Tensor, position_weight: Tensor, output_scale: float,
          token_grad_scale: float, position_grad_scale: float) -> Tensor:
    """Token plus position embedding in one Function (see :class:`_Embed`)."""
    return _embed_apply(ids, token_weight, position_weight, output_scale, token_grad_scale,
                        position_grad_scale)

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

import threading
from typing import Any, Callable, List, Optional, Tuple, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native_layers
from .fused_ops import addmm_zero, applier, linear_backward, linear_forward

__all__ = ["residual_norm", "mlp", "embed", "norm_qkv", "proj_norm_mlp"]

# An FP8 linear's rounding of a GEMM operand to the FP8 values it computes with, for a role
# ("input", "weight" or "grad_output"): (the values for the GEMM that reduces over the
# operand's last dimension, the values for the backward GEMM that reduces over its first, in
# the operand's shape, or None where not asked for by the flag). Per-tensor scaling gives one
# tensor twice; a grouped recipe casts the operand along each dimension with its own groups,
# the first into the float32 buffer given (or None), which only the GEMMs of the call read.
# See `fp8.linear.FP8UnitScaledLinear.values_quantiser`.
Quantiser = Callable[[Tensor, str, bool, Optional[Tensor]], Tuple[Tensor, Optional[Tensor]]]

_layer_norm_backward = torch.ops.aten.native_layer_norm_backward
_gelu_backward = torch.ops.aten.gelu_backward


def _join_norm(x: Tensor, f: Optional[Tensor], branch_weight: float, skip_weight: float,
               weight: Optional[Tensor], bias: Optional[Tensor],
               eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(normed, stream, mean, rstd): the stream ``x`` or ``skip_weight * x + branch_weight *
    f``, and its layer norm with the statistics its backward pass needs."""
    if f is None:
        stream = x.view_as(x)
    elif branch_weight == 1.0:  # (``f`` weighed by the GEMM that made it: one pass)
        stream = torch.add(f, x, alpha=skip_weight)
    else:
        stream = torch.mul(x, skip_weight).add_(f, alpha=branch_weight)
    normed, mean, rstd = torch.native_layer_norm(stream, (x.shape[-1],), weight, bias, eps)
    return normed, stream, mean, rstd


def _join_norm_backward(grad_normed: Optional[Tensor], grad_stream: Optional[Tensor],
                        stream: Tensor, mean: Tensor, rstd: Tensor, weight: Optional[Tensor],
                        bias: Optional[Tensor], next_branch_weight: float,
                        next_skip_weight: float, param_grad_scale: float, need_weight: bool,
                        need_bias: bool, weighed: bool = False
                        ) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(the stream's gradient, the norm's weight and bias gradients) of :func:`_join_norm`,
    the norm's input and the stream leaving it as unit scaling's residual split's branch and
    skip. ``weighed``: ``grad_normed`` already carries ``next_branch_weight`` (folded into
    the GEMM that made it; the norm's backward is linear in it), so the stream's gradient
    takes one pass."""
    if grad_normed is None:
        if grad_stream is not None and next_skip_weight != 1.0:
            grad_stream = grad_stream * next_skip_weight
        return grad_stream, None, None
    if weighed:
        param_grad_scale /= next_branch_weight
        next_branch_weight = 1.0
    mask = [True, weight is not None and need_weight, bias is not None and need_bias]
    grad_branch, grad_w, grad_b = _layer_norm_backward(
        grad_normed.contiguous(), stream, (stream.shape[-1],), mean, rstd, weight, bias, mask)
    if grad_w is not None:
        grad_w = grad_w.mul_(param_grad_scale)
    if grad_b is not None:
        grad_b = grad_b.mul_(param_grad_scale)
    # In place on the norm's fresh gradient: no new buffer (peak memory) for the join.
    if next_branch_weight != 1.0:
        grad_branch = grad_branch.mul_(next_branch_weight)
    if grad_stream is not None:
        grad_branch = grad_branch.add_(grad_stream, alpha=next_skip_weight)
    return grad_branch, grad_w, grad_b


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
        normed, stream, mean, rstd = _join_norm(x, f, branch_weight, skip_weight, weight, bias,
                                                eps)
        ctx.save_for_backward(stream, mean, rstd, weight, bias)
        ctx.scales = (f is not None, next_branch_weight, next_skip_weight, param_grad_scale)
        return normed, stream

    @staticmethod
    def backward(ctx: Any, grad_normed: Optional[Tensor],
                 grad_stream: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        stream, mean, rstd, weight, bias = ctx.saved_tensors
        joined, next_branch_weight, next_skip_weight, param_grad_scale = ctx.scales
        needs = ctx.needs_input_grad
        grad_stream, grad_w, grad_b = _join_norm_backward(
            grad_normed, grad_stream, stream, mean, rstd, weight, bias, next_branch_weight,
            next_skip_weight, param_grad_scale, needs[6], needs[7])
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


def _mlp_forward(rows: Tensor, up_weight: Tensor, up_bias: Optional[Tensor],
                 down_weight: Tensor, down_bias: Optional[Tensor], approximate: str,
                 scales: Tuple[float, ...], down_quantise: Optional[Quantiser] = None,
                 transposed: bool = True) -> Tuple[Tensor, Tensor, Tensor]:
    """(hidden, activated, out) of the MLP on 2-D ``rows`` (``scales``: see :class:`_MLP`).

    With ``down_quantise`` (an FP8 down projection), ``activated`` is GELU's scaled output
    rounded to the FP8 values the down weight's gradient GEMM reads (cast along the rows
    where a grouped recipe casts it so; ``transposed``: that GEMM will run), as the FP8
    linear would cast it."""
    up_out, _, _, gelu_out, _, down_out, _, _ = scales
    # (each bias times its linear's output scale, as `fused_ops.linear_forward` adds it)
    hidden = torch.addmm(addmm_zero(rows) if up_bias is None else up_bias, rows, up_weight.t(),
                         beta=0 if up_bias is None else up_out, alpha=up_out)
    activated = F.gelu(hidden, approximate=approximate)
    activated_t = activated
    if down_quantise is not None:
        activated, activated_t = _quantised(activated.mul_(gelu_out), down_quantise, "input",
                                            transposed, "down.input")
        gelu_out = 1.0
    out = torch.addmm(addmm_zero(rows) if down_bias is None else down_bias, activated,
                      down_weight.t(), beta=0 if down_bias is None else down_out,
                      alpha=down_out * gelu_out)
    return hidden, activated_t, out


def _mlp_backward(grad_rows: Tensor, rows: Tensor, intermediates: List[Tensor],
                  recompute: Callable[[], Tuple[Tensor, Tensor, Tensor]],
                  up_weight: Tensor, up_bias: Optional[Tensor], down_weight: Tensor,
                  approximate: str, scales: Tuple[float, ...], needs: Tuple[bool, ...],
                  input_weight: float = 1.0, up_quantise: Optional[Quantiser] = None,
                  down_quantise: Optional[Quantiser] = None) -> Tuple[Optional[Tensor], ...]:
    """(rows, up weight, up bias, down weight, down bias) gradients of :func:`_mlp_forward`,
    each where ``needs`` asks, the input's gradient times ``input_weight``. ``rows``, the
    weights and the activation are the operands of the backward GEMMs (an FP8 linear's casts
    for them); the quantisers (FP8 linears) round each GEMM's incoming gradient to its FP8
    values.

    ``intermediates``: [hidden, activated], emptied here so that each is freed once used, as
    torch's per-op nodes would (held to the end, they would raise the peak memory); empty (a
    second backward, retain_graph=True): ``recompute()`` (the forward pass's
    :func:`_mlp_forward`) makes them again."""
    _, up_grad_in, up_grad_w, gelu_out, gelu_grad, _, down_grad_in, down_grad_w = scales
    if intermediates:
        hidden, activated = intermediates
        intermediates.clear()
    else:
        hidden, activated, _ = recompute()
    grad_down = grad_down_t = grad_rows
    if down_quantise is not None:
        grad_down, grad_down_t = _quantised(grad_rows, down_quantise, "grad_output", needs[3],
                                               "down.grad")
        gelu_out = 1.0  # (in the activation's values already)
    zero = addmm_zero(grad_rows)
    grad_down_w = grad_down_b = grad_up_w = grad_up_b = grad_x = None
    if needs[3]:
        grad_down_w = torch.addmm(zero, grad_down_t.t(), activated, beta=0,
                                  alpha=down_grad_w * gelu_out)
    del activated, grad_down_t
    if needs[4]:
        grad_down_b = grad_rows.sum(0).mul_(down_grad_w)
    if needs[0] or needs[1] or needs[2]:
        grad_activated = torch.addmm(zero, grad_down, down_weight, beta=0,
                                     alpha=down_grad_in * gelu_grad)
        grad_hidden = _gelu_backward(grad_activated, hidden, approximate=approximate)
        del grad_activated, hidden, grad_down
        grad_up, grad_up_t = _quantised(grad_hidden, up_quantise, "grad_output", needs[1],
                                        "up.grad")
        if needs[0]:
            grad_x = torch.addmm(zero, grad_up, up_weight, beta=0,
                                 alpha=up_grad_in * input_weight)
        if needs[1]:
            grad_up_w = torch.addmm(zero, grad_up_t.t(), rows, beta=0, alpha=up_grad_w)
        if needs[2]:
            grad_up_b = grad_hidden.sum(0).mul_(up_grad_w)
    return grad_x, grad_up_w, grad_up_b, grad_down_w, grad_down_b


class _MLP(torch.autograd.Function):
    """``down(gelu(up(x)))`` with unit scaling's scales, GELU's folded into the down GEMMs.

    ``scales``: (up output, up grad input, up grad weight, gelu output, gelu grad, down
    output, down grad input, down grad weight).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, up_weight: Tensor, up_bias: Optional[Tensor],
                down_weight: Tensor, down_bias: Optional[Tensor], approximate: str,
                scales: Tuple[float, ...]) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        hidden, activated, out = _mlp_forward(rows, up_weight, up_bias, down_weight, down_bias,
                                              approximate, scales)
        ctx.save_for_backward(rows, up_weight, up_bias, down_weight)
        # Kept on ctx, not saved: see _mlp_backward.
        ctx.intermediates = [hidden, activated]
        ctx.meta = (x.shape, approximate, scales, up_bias is not None, down_bias is not None)
        return out.view(*x.shape[:-1], down_weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], ...]:
        rows, up_weight, up_bias, down_weight = ctx.saved_tensors
        x_shape, approximate, scales, has_up_bias, has_down_bias = ctx.meta
        needs = ctx.needs_input_grad
        grad_x, grad_up_w, grad_up_b, grad_down_w, grad_down_b = _mlp_backward(
            grad.reshape(-1, grad.shape[-1]), rows, ctx.intermediates,
            lambda: _mlp_forward(rows, up_weight, up_bias, down_weight, None, approximate,
                                 scales),
            up_weight, up_bias, down_weight, approximate, scales,
            (needs[0], needs[1], has_up_bias and needs[2], needs[3],
             has_down_bias and needs[4]))
        if grad_x is not None:
            grad_x = grad_x.view(x_shape)
        return grad_x, grad_up_w, grad_up_b, grad_down_w, grad_down_b, None, None


_mlp_apply = applier(_MLP)

def mlp(x: Tensor, up_weight: Tensor, up_bias: Optional[Tensor], down_weight: Tensor,
        down_bias: Optional[Tensor], approximate: str, scales: Tuple[float, ...]) -> Tensor:
    """The unit-scaled MLP block in one Function (see :class:`_MLP`); ``x`` non-empty, at
    least 2-D."""
    return _mlp_apply(x, up_weight, up_bias, down_weight, down_bias, approximate, scales)


# Buffers for the casts that only the GEMMs of the call read, kept between calls per thread,
# up to 2^20 elements (4 MiB). Reuse saves the page faults of a fresh buffer: glibc gives
# freed heap back to the system between steps, and each page costs a fault when written
# again. A small buffer is also still in cache when the GEMM reads it. Larger casts, whose
# buffers would be held for the life of the process, are made afresh.
_buffers = threading.local()
_BUFFER_LIMIT = 1 << 20


def _buffer(slot: str, like: Tensor) -> Optional[Tensor]:
    """A float32 CPU buffer shaped like ``like`` for ``slot`` (one GEMM operand of these
    Functions, e.g. "up.input"), the same one at every call with that shape (one of another
    shape is let go: a slot holds one buffer at most); None where ``like`` is larger than
    ``_BUFFER_LIMIT`` or not on the CPU."""
    if like.numel() > _BUFFER_LIMIT or like.device.type != "cpu":
        return None
    held = _buffers.__dict__.setdefault("held", {})
    buffer = held.get(slot)
    if buffer is None or buffer.shape != like.shape:
        buffer = held[slot] = torch.empty(like.shape, dtype=torch.float32)
    return buffer


def _quantised(x: Tensor, quantise: Optional[Quantiser], role: str, transposed: bool,
               slot: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """(the operand for the GEMM that reduces over ``x``'s last dimension, the operand for
    the one that reduces over its first: the values of ``quantise``, or ``x`` twice for a
    float linear; the first again where ``transposed`` is not asked for). ``slot``: the
    first is read only by the GEMMs of this call, before the next cast for the same slot, so
    a grouped cast may write it to that slot's buffer."""
    if quantise is None:
        return x, x
    values, values_t = quantise(x, role, transposed, None if slot is None else _buffer(slot, x))
    return values, values if values_t is None else values_t


def _head_rows(row_scale: Union[float, Tensor], seq: int) -> Union[float, Tensor]:
    """The attention row scale (a float, or a (seq, 1) tensor) for (batch, seq, heads,
    head_dim) tensors."""
    return row_scale.view(seq, 1, 1) if isinstance(row_scale, Tensor) else row_scale


class _NormQKV(torch.autograd.Function):
    """:class:`_ResidualNorm` followed by the attention's (unit-scaled) QKV projection of its
    normed output: (qkv, stream). ``qkv_scales``: the linear's (output, grad input, grad
    weight) scales; ``qkv_quantise``: an FP8 projection's rounding (None: float)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, f: Optional[Tensor], branch_weight: float,
                skip_weight: float, next_branch_weight: float, next_skip_weight: float,
                weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                param_grad_scale: float, qkv_weight: Tensor, qkv_bias: Optional[Tensor],
                qkv_scales: Tuple[float, float, float],
                qkv_quantise: Optional[Quantiser]) -> Tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        normed, stream, mean, rstd = _join_norm(x, f, branch_weight, skip_weight, weight, bias,
                                                eps)
        needs = ctx.needs_input_grad
        rows, rows_t = _quantised(normed.view(-1, normed.shape[-1]), qkv_quantise, "input",
                                  needs[10], "qkv.input")
        qkv_weight, qkv_weight_t = _quantised(qkv_weight, qkv_quantise, "weight",
                                              any(needs[:2]) or any(needs[6:8]), "qkv.weight")
        qkv = linear_forward(rows, qkv_weight, qkv_bias, qkv_scales[0])
        # (each operand as the backward GEMM that reads it casts it)
        ctx.save_for_backward(stream, mean, rstd, weight, bias, rows_t, qkv_weight_t)
        ctx.scales = (f is not None, next_branch_weight, next_skip_weight, param_grad_scale,
                      qkv_scales, qkv_bias is not None, qkv_quantise)
        return qkv.view(*x.shape[:-1], qkv.shape[-1]), stream

    @staticmethod
    def backward(ctx: Any, grad_qkv: Optional[Tensor],
                 grad_stream: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        stream, mean, rstd, weight, bias, rows, qkv_weight = ctx.saved_tensors
        (joined, next_branch_weight, next_skip_weight, param_grad_scale, qkv_scales, has_bias,
         qkv_quantise) = ctx.scales
        needs = ctx.needs_input_grad
        grad_normed = grad_qkv_w = grad_qkv_b = None
        if grad_qkv is not None:
            grad_rows = grad_qkv.reshape(-1, grad_qkv.shape[-1])
            grad_cast, grad_cast_t = _quantised(grad_rows, qkv_quantise, "grad_output",
                                                needs[10], "qkv.grad")
            grad_normed, grad_qkv_w, grad_qkv_b = linear_backward(
                grad_cast, rows, qkv_weight, qkv_scales[1] * (next_branch_weight or 1.0),
                qkv_scales[2], None, True, needs[10], False, grad_cast_t)
            del grad_cast, grad_cast_t
            if has_bias and needs[11]:
                grad_qkv_b = grad_rows.sum(0).mul_(qkv_scales[2])
            del grad_rows
            grad_normed = cast(Tensor, grad_normed).view(stream.shape)
        grad_stream, grad_w, grad_b = _join_norm_backward(
            grad_normed, grad_stream, stream, mean, rstd, weight, bias, next_branch_weight,
            next_skip_weight, param_grad_scale, needs[6], needs[7],
            weighed=next_branch_weight != 0.0)
        del grad_normed
        return (grad_stream, grad_stream if joined else None, None, None, None, None, grad_w,
                grad_b, None, None, grad_qkv_w, grad_qkv_b, None, None)


_normqkv_apply = applier(_NormQKV)

def norm_qkv(x: Tensor, f: Optional[Tensor], branch_weight: float, skip_weight: float,
             next_branch_weight: float, next_skip_weight: float, weight: Optional[Tensor],
             bias: Optional[Tensor], eps: float, param_grad_scale: float, qkv_weight: Tensor,
             qkv_bias: Optional[Tensor], qkv_scales: Tuple[float, float, float],
             qkv_quantise: Optional[Quantiser] = None) -> Tuple[Tensor, Tensor]:
    """(the QKV projection of the next branch's normalised input, the stream): the values of
    :func:`residual_norm` then `fused_ops.linear` (see :class:`_NormQKV`)."""
    native = native_layers.usable()
    casts = native_layers.node_casts((qkv_quantise,))
    if native is not None and casts is not None:
        qkv, stream = native.norm_qkv(x, f, branch_weight, skip_weight, next_branch_weight,
                                      next_skip_weight, weight, bias, eps, param_grad_scale,
                                      qkv_weight, qkv_bias, qkv_scales, casts)
        return qkv, stream
    return _normqkv_apply(x, f, branch_weight, skip_weight, next_branch_weight,
                          next_skip_weight, weight, bias, eps, param_grad_scale, qkv_weight,
                          qkv_bias, qkv_scales, qkv_quantise)


class _ProjNormMLP(torch.autograd.Function):
    """The second half of a pre-norm transformer layer: the attention's heads joined and
    times the attention row scale (in the one copy that joins them), the output projection
    (bias-free), its residual join into the stream, the MLP's layer norm and the MLP: (the
    MLP's output, the stream). The values and gradients of the heads' transpose and reshape,
    `fused_ops.linear` (with ``row_scale``), :class:`_ResidualNorm` and :class:`_MLP` in turn.

    ``heads``: the attention output, (batch, heads, seq, head_dim); ``row_scale``: a float or
    a (seq, 1) tensor. ``proj_scales``: the projection's (output, grad input, grad weight)
    scales; ``residual``: (branch weight, skip weight, next branch weight, next skip weight,
    eps, norm parameter grad scale, output weight): the MLP's output is times the output
    weight in the forward pass only (the next join's branch weight, folded into the GEMM);
    ``mlp_scales``: see :class:`_MLP`; ``quantisers``: the (projection, up, down) FP8
    linears' roundings, None for a float one.
    """

    @staticmethod
    def forward(ctx: Any, heads: Tensor, row_scale: Union[float, Tensor], proj_weight: Tensor,
                proj_scales: Tuple[float, float, float], stream: Tensor,
                norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
                residual: Tuple[float, ...], up_weight: Tensor, up_bias: Optional[Tensor],
                down_weight: Tensor, down_bias: Optional[Tensor], approximate: str,
                mlp_scales: Tuple[float, ...],
                quantisers: Tuple[Optional[Quantiser], ...]) -> Tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        branch_weight, skip_weight, _, _, eps, _, output_weight = residual
        proj_quantise, up_quantise, down_quantise = quantisers
        needs = ctx.needs_input_grad
        # Whether a gradient flows back into the MLP's input (and so through the projection).
        need_normed = needs[0] or any(needs[4:7])
        batch, count, seq, head_dim = heads.shape
        if proj_quantise is None:
            # The row scale depends on the query position only, so it commutes with the
            # bias-free projection: applied to the projection's output, the projection reads
            # the attention output itself, which the attention kernel keeps for its backward
            # pass anyway (in a layout where joining the heads is a view): no scaled copy held.
            attended = heads.transpose(1, 2).reshape(batch * seq, count * head_dim)
        else:
            # An FP8 projection casts its input as it comes: row-scaled, in the one copy that
            # joins the heads.
            attended = heads.new_empty((batch * seq, count * head_dim))
            torch.mul(heads.transpose(1, 2), _head_rows(row_scale, seq),
                      out=attended.view(batch, seq, count, head_dim))
        attended, attended_t = _quantised(attended, proj_quantise, "input", needs[2],
                                          "proj.input")
        proj_weight, proj_weight_t = _quantised(proj_weight, proj_quantise, "weight", needs[0],
                                                "proj.weight")
        # The join's branch weight in the projection's GEMM, the skip's in one in-place pass.
        joined = linear_forward(attended, proj_weight, None, proj_scales[0] * branch_weight)
        joined = joined.view(stream.shape)
        if proj_quantise is None:
            joined = joined.mul_(row_scale)
        joined = joined.add_(stream, alpha=skip_weight)
        normed, mean, rstd = torch.native_layer_norm(joined, (joined.shape[-1],), norm_weight,
                                                     norm_bias, eps)
        rows, rows_t = _quantised(normed.view(-1, normed.shape[-1]), up_quantise, "input",
                                  needs[8], "up.input")
        up_cast, up_cast_t = _quantised(up_weight, up_quantise, "weight", need_normed,
                                        "up.weight")
        down_cast, down_cast_t = _quantised(down_weight, down_quantise, "weight",
                                            any(needs[:10]), "down.weight")
        forward_scales = mlp_scales
        if output_weight != 1.0:
            forward_scales = (*mlp_scales[:5], mlp_scales[5] * output_weight, *mlp_scales[6:])
        hidden, activated, out = _mlp_forward(rows, up_cast, up_bias, down_cast, down_bias,
                                              approximate, forward_scales, down_quantise,
                                              needs[10])
        # Each operand as the backward GEMM that reads it casts it; under a grouped recipe
        # (other casts for the backward GEMMs) the float weights too, for a recomputation.
        grouped = rows_t is not rows or up_cast_t is not up_cast
        del rows, up_cast
        ctx.save_for_backward(attended_t, proj_weight_t, joined, mean, rstd, norm_weight,
                              norm_bias, rows_t, up_cast_t, up_bias, down_cast_t,
                              up_weight if grouped else None,
                              down_weight if grouped else None)
        ctx.intermediates = [hidden, activated]  # see _mlp_backward
        ctx.meta = (row_scale, head_dim, proj_scales, residual, approximate, mlp_scales,
                    up_bias is not None, down_bias is not None, quantisers, grouped)
        return out.view(*stream.shape[:-1], out.shape[-1]), joined

    @staticmethod
    def backward(ctx: Any, grad_out: Optional[Tensor],
                 grad_stream: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        (attended, proj_weight, joined, mean, rstd, norm_weight, norm_bias, rows, up_weight,
         up_bias, down_weight, up_float, down_float) = ctx.saved_tensors
        (row_scale, head_dim, proj_scales, residual, approximate, mlp_scales, has_up_bias,
         has_down_bias, quantisers, grouped) = ctx.meta
        proj_quantise, up_quantise, down_quantise = quantisers
        _, _, next_branch_weight, next_skip_weight, eps, param_grad_scale, _ = residual
        needs = ctx.needs_input_grad

        def recompute() -> Tuple[Tensor, Tensor, Tensor]:
            if not grouped:
                return _mlp_forward(rows, up_weight, up_bias, down_weight, None, approximate,
                                    mlp_scales, down_quantise, needs[10])
            # The forward GEMMs' operands, not kept: cast again from the norm's output.
            normed = torch.native_layer_norm(joined, (joined.shape[-1],), norm_weight,
                                             norm_bias, eps)[0]
            normed_rows = _quantised(normed.view(-1, normed.shape[-1]), up_quantise, "input",
                                     False)[0]
            return _mlp_forward(normed_rows, _quantised(up_float, up_quantise, "weight",
                                                        False)[0],
                                up_bias, _quantised(down_float, down_quantise, "weight",
                                                    False)[0],
                                None, approximate, mlp_scales, down_quantise, needs[10])

        grad_normed = grad_up_w = grad_up_b = grad_down_w = grad_down_b = None
        if grad_out is not None:
            grad_normed, grad_up_w, grad_up_b, grad_down_w, grad_down_b = _mlp_backward(
                grad_out.reshape(-1, grad_out.shape[-1]), rows, ctx.intermediates, recompute,
                up_weight, up_bias, down_weight, approximate, mlp_scales,
                (True, needs[8], has_up_bias and needs[9], needs[10],
                 has_down_bias and needs[11]), next_branch_weight or 1.0, up_quantise,
                down_quantise)
            grad_normed = cast(Tensor, grad_normed).view(joined.shape)
        grad_joined, grad_w, grad_b = _join_norm_backward(
            grad_normed, grad_stream, joined, mean, rstd, norm_weight, norm_bias,
            next_branch_weight, next_skip_weight, param_grad_scale, needs[5], needs[6],
            weighed=next_branch_weight != 0.0)
        del grad_normed
        if grad_joined is None:
            return (None,) * 15
        # (times the row scale first where that follows the GEMM)
        grad_projected, grad_projected_t = grad_joined, None
        if proj_quantise is not None:
            grad_projected, grad_projected_t = _quantised(
                grad_joined.view(-1, grad_joined.shape[-1]), proj_quantise, "grad_output",
                needs[2], "proj.grad")
        grad_attended, grad_proj_w, _ = linear_backward(
            grad_projected, attended, proj_weight, proj_scales[1], proj_scales[2],
            row_scale if proj_quantise is None else None, needs[0], needs[2], False,
            grad_projected_t)
        del grad_projected, grad_projected_t
        grad_heads = None
        if grad_attended is not None:
            batch, seq = joined.shape[:2]
            grad_heads = grad_attended.view(batch, seq, -1, head_dim)
            if proj_quantise is not None:
                grad_heads = grad_heads.mul_(_head_rows(row_scale, seq))
            grad_heads = grad_heads.transpose(1, 2)
        return (grad_heads, None, grad_proj_w, None, grad_joined, grad_w, grad_b, None,
                grad_up_w, grad_up_b, grad_down_w, grad_down_b, None, None, None)


_projnormmlp_apply = applier(_ProjNormMLP)

_FLOAT = (None, None, None)

def proj_norm_mlp(heads: Tensor, row_scale: Union[float, Tensor], proj_weight: Tensor,
                  proj_scales: Tuple[float, float, float], stream: Tensor,
                  norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
                  residual: Tuple[float, ...], up_weight: Tensor, up_bias: Optional[Tensor],
                  down_weight: Tensor, down_bias: Optional[Tensor], approximate: str,
                  mlp_scales: Tuple[float, ...],
                  quantisers: Tuple[Optional[Quantiser], ...] = _FLOAT
                  ) -> Tuple[Tensor, Tensor]:
    """(the MLP's output, the stream) of a layer's second half (see :class:`_ProjNormMLP`)."""
    native = native_layers.usable()
    casts = native_layers.node_casts(quantisers)
    if native is not None and casts is not None:
        tensor_scale = row_scale if isinstance(row_scale, Tensor) else None
        out, joined = native.proj_norm_mlp(
            heads, tensor_scale, 1.0 if tensor_scale is not None else row_scale, proj_weight,
            proj_scales, stream, norm_weight, norm_bias, residual, up_weight, up_bias,
            down_weight, down_bias, approximate, mlp_scales, casts)
        return out, joined
    return _projnormmlp_apply(heads, row_scale, proj_weight, proj_scales, stream, norm_weight,
                              norm_bias, residual, up_weight, up_bias, down_weight, down_bias,
                              approximate, mlp_scales, quantisers)


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

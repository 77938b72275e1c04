"""The FP8 linear layer under the delayed and the grouped recipes (rowwise, block, mx, nvfp4).

A linear layer runs three GEMMs, and each casts its two operands with groups along its own
reduction dimension (``x`` is M x K, the weight N x K, the output gradient M x N):

- forward, ``y = x @ w.T``, reduces over K: rows of ``x`` and of ``w``;
- input gradient, ``dx = dy @ w``, reduces over N: rows of ``dy`` and columns of ``w``;
- weight gradient, ``dw = dy.T @ x``, reduces over M: columns of ``dy`` and of ``x``.

A transposed operand is cast again from the high-precision tensor, never from the FP8 copy
(as TransformerEngine and torchao do), so the forward pass keeps ``x`` and ``w`` in float32 for
the backward pass. It is passed as a transposed view: the host library's block kernels then
cast it with column groups in its own layout, and the GEMM takes the transposed result, so no
transposing copy is made. ``grad_weight_high_precision`` computes ``dw`` from float32 operands.

Under "delayed" scaling each role (input, weight, output gradient) has one per-tensor scale:
the AMAX rule applied to the max (or the most recent) of the amaxes of that role's previous
casts, kept in an ``amax_history`` tensor of shape (3, ``amax_history_length``), newest first,
which the layer registers as a buffer (so checkpoints hold it). A cast reads the history, then
pushes its own amax, when ``update_history`` is set (training steps; not evaluation). Before
any cast the history is zero, which the AMAX rule maps to scale 0. An inf or NaN amax raises
:class:`~.scaling.NonFiniteAmaxError` before it can enter the history.

Values are computed in float32 (inputs of other float dtypes are converted, the results
converted back), on any device. Under "rowwise", ``use_scaled_mm`` multiplies the operands as
float8 tensors with ``torch._scaled_mm`` and the per-row power-of-two scales (by default on CUDA
with OCP formats and sizes that divide by 16; forced on, it runs on CPU too, to check it): the
products of FP8 values are exact in float32, so it differs from the simulation only in the
order of the float32 sums.

Traced for PopTorch (inside :func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing`, or while
a program's ``poptorch`` traces), the rowwise, block and MX recipes take a form built from
graph ops alone (:func:`traced_recipe_linear`), since PopART differentiates the forward graph
and never runs this module's backward pass; delayed and NVFP4 scaling have no such form.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..ops.trace_switch import is_ipu_tracing
from .fp8_config import FP8Config
from .fp8_formats import FP8Format
from .group_cast import (
    GroupCast,
    Grouping,
    group_cast,
    group_cast_pair,
    host_pair_values,
    pair_arguments,
)
from .scaling import NonFiniteAmaxError, log2_scale
from .stats import stats_enabled
from .values import quantise_values

__all__ = ["HISTORY_ROLES", "recipe_applies", "recipe_linear", "new_amax_history",
           "delayed_log2_scale", "push_amax", "role_cast", "grouped_operand_values",
           "rowwise_scaled_mm_supported", "traced_recipe_linear"]

HISTORY_ROLES = ("input", "weight", "grad_output")
_UNSCALED = (1.0, 1.0, 1.0, 1.0)


def recipe_applies(config: FP8Config) -> bool:
    """Whether ``config``'s recipe runs through :func:`recipe_linear` (delayed and grouped)."""
    return config.scaling == "delayed" or config.grouped


def new_amax_history(config: FP8Config, device: Optional[torch.device] = None) -> torch.Tensor:
    """An all-zero amax history for the three roles: (3, ``amax_history_length``) float32."""
    return torch.zeros(len(HISTORY_ROLES), config.amax_history_length, dtype=torch.float32,
                       device=device)


def _role_format(config: FP8Config, role: str):
    return {"input": config.activation, "weight": config.weight,
            "grad_output": config.gradient}[role]


def _role_margin(config: FP8Config, role: str) -> int:
    return {"input": config.activation_margin, "weight": config.weight_margin,
            "grad_output": config.gradient_margin}[role]


def delayed_log2_scale(history: torch.Tensor, config: FP8Config, role: str) -> int:
    """The delayed recipe's scale for ``role`` from its row of ``history``."""
    row = history[HISTORY_ROLES.index(role)]
    amax = row.max() if config.amax_reduction == "max" else row[0]
    return log2_scale(float(amax), _role_format(config, role), _role_margin(config, role))


def push_amax(history: torch.Tensor, role: str, x: torch.Tensor) -> None:
    amax = x.detach().abs().max().to(torch.float32) if x.numel() else torch.zeros(())
    if not bool(torch.isfinite(amax)):
        raise NonFiniteAmaxError(f"the amax of the {role} is {float(amax)}; it cannot enter "
                                 "the delayed recipe's amax history")
    row = history[HISTORY_ROLES.index(role)]
    row.copy_(torch.cat([amax.reshape(1).to(row.device), row[:-1]]))


def _grouping(config: FP8Config, role: str) -> Tuple[Grouping, str]:
    scaling = config.scaling
    if scaling == "rowwise":
        return Grouping("row"), "amax"
    size = config.group_size
    assert size is not None
    if scaling == "block":
        return Grouping("block" if role == "weight" else "tile", size), "amax"
    return Grouping("tile", size), scaling  # "mx" and "nvfp4"


def role_cast(t: torch.Tensor, config: FP8Config, role: str, site: str,
              log2_scale: Optional[int] = None) -> GroupCast:
    """The FP8 cast of the 2-D operand ``t`` in ``role``, grouped along its last dimension
    (the consuming GEMM's reduction dimension). ``log2_scale`` is the delayed recipe's
    per-tensor scale."""
    fmt = _role_format(config, role)
    if config.scaling == "delayed":
        if config.rounding == "nearest" and log2_scale is not None and not stats_enabled():
            # The per-tensor values path (one pass of the host kernel where it applies): the
            # same values as the grouped cast with one group.
            values, scale = quantise_values(t, fmt, log2_scale, 0, config.overflow)
            return GroupCast(values, torch.full((1, 1), scale, dtype=torch.int32))
        grouping, rule = Grouping("tensor"), "amax"
    else:
        grouping, rule = _grouping(config, role)
    return group_cast(t, fmt, grouping, rule, _role_margin(config, role), config.overflow,
                      config.rounding, config.scale_rounding, log2_scale, site=site)


def _casts(t: torch.Tensor, config: FP8Config, role: str, site: str,
           log2_scale: Optional[int], transposed: bool, rows: bool = True
           ) -> Tuple[Optional[GroupCast], Optional[GroupCast]]:
    """The casts of ``t`` in ``role`` that are asked for: along its rows (``rows``) and, for
    a grouped recipe, along its columns (``transposed``: the cast of ``t.t()``, site
    ``<site>_t``), the two from one read of ``t`` where the host library's kernels apply."""
    if rows and transposed:
        grouping, rule = _grouping(config, role)
        return group_cast_pair(t, _role_format(config, role), grouping, rule,
                               _role_margin(config, role), config.overflow, config.rounding,
                               config.scale_rounding, site=site, site_t=f"{site}_t")
    along_rows = role_cast(t, config, role, site, log2_scale) if rows else None
    along_columns = role_cast(t.t(), config, role, f"{site}_t") if transposed else None
    return along_rows, along_columns


def pair_kernel_casts(config: FP8Config, role: str) -> Optional[Tuple[int, Tuple[Any, ...]]]:
    """(the tile size, -1 for whole rows; the host pair kernel's arguments:
    `group_cast.pair_arguments`) where :func:`grouped_operand_values` casts a GEMM operand
    in ``role`` both ways by one call of the host library's pair kernels (tiles: both tile
    casts from one read; rows: both the per-row and the per-column cast from two), unless
    the statistics record the casts; else None."""
    grouping, rule = _grouping(config, role)
    if ((config.grad_weight_high_precision and role != "weight")
            or (config.scaling == "block" and role == "weight")
            or grouping.kind not in ("tile", "row")
            or config.rounding != "nearest" or config.overflow != "saturate"):
        return None
    args = pair_arguments(_role_format(config, role), rule, _role_margin(config, role),
                          config.scale_rounding)
    size = grouping.size if grouping.kind == "tile" else -1
    return None if args is None or size is None else (size, args)


def group_kernel_casts(config: FP8Config, role: str
                       ) -> Optional[Tuple[Tuple[int, int], Tuple[int, int], Tuple[Any, ...]]]:
    """Where :func:`grouped_operand_values`'s casts of a GEMM operand in ``role`` are the
    host library's group kernel's (unless the statistics record them): (the groups' (rows,
    columns) in the operand for the cast along its rows, those for the cast along its
    columns ((0, 0): the first serves both GEMMs, as square blocks do), the kernel's
    arguments: `group_cast.pair_arguments`), -1 standing for a whole dimension; else None."""
    grouping, rule = _grouping(config, role)
    if ((config.grad_weight_high_precision and role != "weight")
            or config.rounding != "nearest" or config.overflow != "saturate"):
        return None
    args = pair_arguments(_role_format(config, role), rule, _role_margin(config, role),
                          config.scale_rounding)
    size = grouping.size or 0
    shapes = {"row": ((1, -1), (-1, 1)), "tile": ((1, size), (size, 1)),
              "block": ((size, size), (0, 0))}.get(grouping.kind)
    return None if args is None or shapes is None else (shapes[0], shapes[1], args)


def grouped_operand_values(t: torch.Tensor, config: FP8Config, role: str, site: str,
                           transposed: bool, out: Optional[torch.Tensor] = None
                           ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The FP8 values of the 2-D GEMM operand ``t`` in ``role`` under a grouped recipe, as
    :func:`recipe_linear` casts it: (cast along its last dimension, for the GEMM that reduces
    over it; where ``transposed``, the operand of the backward GEMM that reduces over its
    first dimension, in ``t``'s shape, else None). That second operand is the cast along the
    first dimension, the first cast itself for square weight blocks ("block"), or ``t`` in
    float32 where ``grad_weight_high_precision`` keeps the weight gradient's GEMM unrounded.
    ``site`` names the casts for the statistics. ``out``: a float32 tensor shaped like
    ``t`` that the first may be written to, where the host kernel makes both."""
    high_precision = config.grad_weight_high_precision and role != "weight"
    square_blocks = config.scaling == "block" and role == "weight"
    pair = pair_kernel_casts(config, role) if transposed and not stats_enabled() else None
    if pair is not None:
        found = host_pair_values(t, pair[0], pair[1], out)
        if found is not None:
            return found
    rows, columns = _casts(t, config, role, site, None,
                           transposed and not (high_precision or square_blocks))
    assert rows is not None
    if not transposed:
        return rows.values, None
    if columns is not None:
        return rows.values, columns.values.t()
    return rows.values, t.to(torch.float32) if high_precision else rows.values


_ZERO = torch.zeros(())


def _gemm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * a @ b``; on the CPU with the scale inside the GEMM (no pass of its own)."""
    if alpha == 1.0:
        return a @ b
    if a.device.type == "cpu":
        return torch.addmm(_ZERO, a, b, beta=0, alpha=alpha)
    return (a @ b).mul_(alpha)


def rowwise_scaled_mm_supported(a: torch.Tensor, b: torch.Tensor, a_fmt: FP8Format,
                                b_fmt: FP8Format) -> bool:
    """Whether ``torch._scaled_mm`` is used by default for ``a @ b.T`` under "rowwise": on
    CUDA, with OCP formats, not both E5M2, and sizes that are multiples of 16."""
    if not hasattr(torch, "_scaled_mm") or a.device.type != "cuda":
        return False
    names = {a_fmt.name, b_fmt.name}
    if names - {"E4M3FN", "E5M2"} or names == {"E5M2"}:
        return False
    return all(size % 16 == 0 for size in (*a.shape, b.shape[0]))


def _as_float8(cast: GroupCast, fmt: FP8Format) -> Tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, float32 per-row decode scales ``2**-s``) of a rowwise cast; exact, as
    ``values * 2**s`` is an FP8 value."""
    dtype = fmt.torch_dtype
    if dtype is None or not hasattr(torch, "_scaled_mm") or cast.log2_scales is None:
        raise RuntimeError(f"torch._scaled_mm or torch's {fmt.name} dtype is missing in this "
                           f"torch ({torch.__version__})")
    scales = cast.log2_scales.to(torch.float64).reshape(-1, 1)
    # (contiguous: torch._scaled_mm takes a row-major first and column-major second operand)
    codes = (cast.values * torch.exp2(scales).to(torch.float32)).to(dtype).contiguous()
    return codes, torch.exp2(-scales).to(torch.float32)


def _product(a: GroupCast, b: GroupCast, a_fmt: FP8Format, b_fmt: FP8Format, alpha: float,
             use_scaled_mm: Optional[bool]) -> torch.Tensor:
    """``alpha * a @ b.T`` of two casts grouped along their last dimension, by a float32 GEMM
    of their values or, for rowwise casts, by ``torch._scaled_mm`` on float8 codes."""
    if use_scaled_mm is None:
        use_scaled_mm = (a.log2_scales is not None and a.log2_scales.dim() == 2
                         and rowwise_scaled_mm_supported(a.values, b.values, a_fmt, b_fmt))
    if not use_scaled_mm:
        return _gemm(a.values, b.values.t(), alpha)
    a8, a_scale = _as_float8(a, a_fmt)
    b8, b_scale = _as_float8(b, b_fmt)
    out = torch._scaled_mm(a8, b8.t(), scale_a=a_scale, scale_b=b_scale.reshape(1, -1),
                           out_dtype=torch.float32)
    if isinstance(out, tuple):  # torch 2.1-2.3 also returned the output's amax
        out = out[0]
    return out if alpha == 1.0 else out.mul_(alpha)


class _RecipeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, config, site, scales, history,  # type: ignore[override]
                update_history, use_scaled_mm):
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
        w = weight.to(torch.float32)
        delayed = config.scaling == "delayed"
        if config.scaling != "rowwise":
            use_scaled_mm = False
        scale_x = scale_w = None
        if delayed:
            scale_x = delayed_log2_scale(history, config, "input")
            scale_w = delayed_log2_scale(history, config, "weight")
            if update_history:
                push_amax(history, "input", x2)
                push_amax(history, "weight", w)
        # Each operand's cast along its other dimension (for a backward GEMM) is made here,
        # from the same read of it, and kept instead of the float32 operand.
        need_w_t = not delayed and ctx.needs_input_grad[0]
        need_x_t = (not delayed and ctx.needs_input_grad[1]
                    and not config.grad_weight_high_precision)
        # On the CPU, without torch._scaled_mm, the grouped recipes' GEMMs read float32
        # values alone, cast as the two-Function layer casts them (no scales made).
        ctx.values_only = not delayed and not use_scaled_mm and x2.device.type == "cpu"
        if ctx.values_only:
            x_rows, ctx.x_t = grouped_operand_values(x2, config, "input", f"{site}.input",
                                                     ctx.needs_input_grad[1])
            w_rows, ctx.w_t = grouped_operand_values(w, config, "weight", f"{site}.weight",
                                                     need_w_t)
            y = _gemm(x_rows, w_rows.t(), scales[0])
        else:
            xq, ctx.x_t = _casts(x2, config, "input", f"{site}.input", scale_x, need_x_t)
            wq, ctx.w_t = _casts(w, config, "weight", f"{site}.weight", scale_w,
                                 need_w_t and config.scaling != "block")
            assert xq is not None and wq is not None
            if need_w_t and config.scaling == "block":
                # Square weight blocks: the transposed cast is the forward cast transposed.
                ctx.w_t = GroupCast(wq.values.t(), None)
            y = _product(xq, wq, config.activation, config.weight, scales[0], use_scaled_mm)
            # A per-tensor scale casts a transposed operand to the transposed values: keep
            # those.
            if delayed:
                ctx.save_for_backward(xq.values, wq.values)
            else:
                ctx.save_for_backward(x2 if config.grad_weight_high_precision else None)
        if bias is not None:  # (before the output scale, as `U.linear`'s)
            y = y.add_(bias.to(torch.float32), alpha=scales[0])
        ctx.meta = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype,
                    config, site, scales, history, update_history, use_scaled_mm)
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        (x_shape, x_dtype, w_dtype, b_dtype, config, site, scales, history, update,
         use_scaled_mm) = ctx.meta
        g2 = grad_output.reshape(-1, grad_output.shape[-1]).to(torch.float32)
        grad_x = grad_w = grad_b = None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if config.scaling == "delayed":
            saved_x, saved_w = ctx.saved_tensors
            scale_g = delayed_log2_scale(history, config, "grad_output")
            if update:
                push_amax(history, "grad_output", g2)
            gq = role_cast(g2, config, "grad_output", f"{site}.grad_output", scale_g).values
            if need_x:
                grad_x = _gemm(gq, saved_w, scales[1])
            if need_w:
                grad_w = _gemm(gq.t(), saved_x, scales[2])
        elif ctx.values_only:
            g_values, g_values_t = grouped_operand_values(g2, config, "grad_output",
                                                          f"{site}.grad_output", need_w)
            if need_x:
                grad_x = _gemm(g_values, ctx.w_t, scales[1])
            if need_w:
                assert g_values_t is not None
                grad_w = _gemm(g_values_t.t(), ctx.x_t, scales[2])
        else:
            high_precision = config.grad_weight_high_precision
            g_rows, g_t = _casts(g2, config, "grad_output", f"{site}.grad_output", None,
                                 need_w and not high_precision, rows=need_x)
            if need_x:
                assert g_rows is not None
                grad_x = _product(g_rows, ctx.w_t, config.gradient, config.weight, scales[1],
                                  use_scaled_mm)
            if need_w and high_precision:
                grad_w = _gemm(g2.t(), ctx.saved_tensors[0], scales[2])
            elif need_w:
                assert g_t is not None
                grad_w = _product(g_t, ctx.x_t, config.gradient, config.activation, scales[2],
                                  use_scaled_mm)
        if grad_x is not None:
            grad_x = grad_x.reshape(x_shape).to(x_dtype)
        if grad_w is not None:
            grad_w = grad_w.to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
            grad_b = (grad_b.mul_(scales[3]) if scales[3] != 1.0 else grad_b).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _check_traced(config: FP8Config) -> None:
    if config.scaling == "delayed":
        raise ValueError(
            "the delayed recipe has no PopTorch form: its amax history is updated on the "
            "host between steps (trace with 'amax' or a grouped recipe)")
    if config.scaling == "nvfp4":
        raise ValueError("the nvfp4 recipe has no PopTorch form: the IPU's grouped cast "
                         "(Fp8GroupQuantise) has no E4M3 block scales nor E2M1 elements")
    if config.rounding != "nearest":
        raise ValueError("FP8 under ipu_tracing() rounds to nearest: the grouped custom ops "
                         "have no stochastic rounding (set rounding: nearest)")


def _traced_cast(t: torch.Tensor, config: FP8Config, role: str, gradient: bool = False
                 ) -> torch.Tensor:
    """``t``'s cast in ``role`` grouped along its last dimension, as one custom op: the
    values (``Fp8GroupQuantise``), or the identity whose gradient is cast
    (``Fp8GroupGradientQuantise``)."""
    # Imported when first traced: the ops' module loads the codelets' host emulation, which
    # the eager form never needs.
    from .group_cast_ops import grouped_quantise, grouped_quantise_gradient

    grouping, rule = _grouping(config, role)
    cast = grouped_quantise_gradient if gradient else grouped_quantise
    return cast(t, _role_format(config, role).name, grouping, rule, _role_margin(config, role),
                config.overflow == "saturate", config.scale_rounding)


def _gradient_only(t: torch.Tensor) -> torch.Tensor:
    """Zero (for finite ``t``) whose gradient reaches ``t`` whole."""
    return t - t.detach()


def traced_recipe_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         config: FP8Config,
                         scales: Tuple[float, float, float, float] = _UNSCALED) -> torch.Tensor:
    """The PopTorch form of :func:`recipe_linear` for the rowwise, block and MX recipes, from
    the grouped custom ops and ordinary differentiable ops.

    The value is the product of the operands cast along K by ``Fp8GroupQuantise``. Each
    backward GEMM casts its operands along its own reduction dimension, but PopART's autodiff
    multiplies a gradient by the forward values of a product's operands, so each gradient
    comes from a product of its own, added as ``p - p.detach()`` (zero in value, for finite
    ``p``). ``Q(t)`` below is ``t`` cast along its last dimension:

    - input gradient: ``x @ Q(w.T)`` (the weight cast along N), its output through
      ``Fp8GroupGradientQuantise``, so ``dx = Q(dy) @ Q(w.T).T``. Under "block", whose weight
      blocks are square, ``Q(w.T)`` is the forward cast transposed, and the value's product
      serves (its input cast passes the gradient straight through): one product fewer;
    - weight gradient: ``(w @ Q(x.T)).T`` (the input cast along M), the product through
      ``Fp8GroupGradientQuantise`` before the transpose, so that ``dy.T`` is cast along M:
      ``dw = Q(dy.T) @ Q(x.T).T``; with ``grad_weight_high_precision``, ``(w @ x.T).T`` and
      no casts.

    These are the eager form's casts and GEMMs (the casts' values bit for bit); a layer whose
    input and weight both take gradients holds two (block) or three forward products instead
    of one, a gradient no one asks for (``requires_grad``, grad mode) none. ``scales`` are
    applied as the eager form applies them, by the package's scale ops (``ScaledIdentity``
    when traced).
    """
    from ..ops.scaling_primitive import scale_bwd, scale_fwd

    _check_traced(config)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight expects {weight.shape[-1]}")
    # A gradient's product is there only where autograd (PopART) will ask for the gradient.
    need_x = torch.is_grad_enabled() and x.requires_grad
    need_w = torch.is_grad_enabled() and weight.requires_grad
    block = config.scaling == "block"
    x2 = x.reshape(-1, x.shape[-1])
    w_rows = _traced_cast(weight.detach(), config, "weight")
    x_rows = _traced_cast(scale_bwd(x2, scales[1]) if block and need_x else x2.detach(),
                          config, "input")
    y = torch.nn.functional.linear(x_rows, w_rows)
    if block and need_x:
        y = _traced_cast(y, config, "grad_output", gradient=True)
    elif need_x:
        w_columns = _traced_cast(weight.detach().t(), config, "weight")
        grad_x = torch.matmul(scale_bwd(x2, scales[1]), w_columns)
        y = y + _gradient_only(_traced_cast(grad_x, config, "grad_output", gradient=True))
    if need_w:
        w = scale_bwd(weight, scales[2])
        if config.grad_weight_high_precision:
            grad_w = torch.matmul(w, x2.detach().t())
        else:
            x_columns = _traced_cast(x2.detach().t(), config, "input")
            grad_w = _traced_cast(torch.matmul(w, x_columns), config, "grad_output",
                                  gradient=True)
        y = y + _gradient_only(grad_w.t())
    if bias is not None:
        y = y + scale_bwd(bias, scales[3])
    y = scale_fwd(y, scales[0])
    return y.reshape(*x.shape[:-1], weight.shape[0])


def recipe_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  config: FP8Config, site: str = "linear",
                  scales: Tuple[float, float, float, float] = _UNSCALED,
                  amax_history: Optional[torch.Tensor] = None,
                  update_history: Optional[bool] = None,
                  use_scaled_mm: Optional[bool] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` under a delayed or grouped recipe (see the module docstring).

    ``scales`` are unit scaling's (output, input gradient, weight gradient, bias gradient)
    factors, applied to the GEMMs' products. ``amax_history`` is the delayed recipe's state
    (:func:`new_amax_history`), updated in place when ``update_history`` (default: whether
    autograd records this call). ``use_scaled_mm`` (rowwise only): None picks
    ``torch._scaled_mm`` where :func:`rowwise_scaled_mm_supported` says so, True forces it,
    False never uses it.

    Traced for PopTorch it is :func:`traced_recipe_linear` (``amax_history``,
    ``update_history`` and ``use_scaled_mm`` then play no part).
    """
    if not recipe_applies(config):
        raise ValueError(f"recipe_linear is for the delayed and grouped recipes, not "
                         f"{config.scaling!r}")
    if is_ipu_tracing():
        return traced_recipe_linear(x, weight, bias, config, scales)
    if config.scaling == "delayed":
        if amax_history is None:
            raise ValueError("delayed scaling keeps an amax history: use an FP8Linear (e.g. "
                             "from simulate_fp8), or pass amax_history")
        expected = (len(HISTORY_ROLES), config.amax_history_length)
        if tuple(amax_history.shape) != expected:
            raise ValueError(f"amax_history has shape {tuple(amax_history.shape)}; this "
                             f"config needs {expected}")
    if use_scaled_mm and config.scaling != "rowwise":
        raise ValueError(f"the torch._scaled_mm path takes per-tensor (static, amax) and "
                         f"rowwise scales, not {config.scaling!r}")
    if update_history is None:
        update_history = torch.is_grad_enabled()
    return _RecipeLinear.apply(x, weight, bias, config, site, scales, amax_history,
                               update_history, use_scaled_mm)

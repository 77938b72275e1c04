"""FP8 linear layers: casts around a matmul, in the forward and in the backward pass.

Forward: the input and the weight are cast to the activation and weight formats (F143 by
default), each with its own per-tensor scale, and multiplied. Backward: the output gradient is
cast to the gradient format (F152 by default, margin 3 under AMAX) and the input and weight
gradients are computed from the FP8 values. The bias is added, and its gradient summed, in
the input's precision. Only FP8 codes are saved for the backward pass.

The product of two FP8 tensors is computed either from their values in float32 (float64 for
float64 inputs), which runs anywhere, or by ``torch._scaled_mm`` fed with the codes and the two
power-of-two scales. Both give the exact products of the FP8 values and differ only in float32
accumulation order. Without ``torch._scaled_mm`` the codes are never needed: the operands are
rounded straight to their FP8 values in one pass (:func:`~ipu_unit_scaling.fp8.values.
quantise_values`) and those values are what the backward pass keeps. Recorded casts
(:func:`fp8_stats`) and stochastic rounding go through the codes.

Over 600 lines because the eager, the ``torch._scaled_mm`` and the traced (PopTorch) forms of
the FP8 linear, the matmul and the two layer classes share one set of cast helpers: kept
together, a change to how a role is cast reaches every form at once.
"""
from __future__ import annotations

import math
from typing import Any, Callable, List, Optional, Tuple, Type, TypeVar

import torch
from torch import nn

from ..ops.trace_switch import is_ipu_tracing
from .fp8_config import FP8Config
from .fp8_formats import FP8Format
from .recipe_linear import (
    delayed_log2_scale,
    grouped_operand_values,
    new_amax_history,
    push_amax,
    recipe_applies,
    recipe_linear,
    role_cast,
)
from .scaling import Fp8Tensor, cast_from_fp8, cast_to_fp8
from .stats import record_values, stats_enabled
from .values import quantise_values

__all__ = [
    "fp8_linear", "fp8_matmul", "FP8Linear", "FP8UnitScaledLinear", "scaled_mm_supported",
    "fp8_tensor_matmul", "fp8_tensor_transpose",
]

_DEFAULT_CONFIG = FP8Config()
_LinearT = TypeVar("_LinearT", bound="FP8Linear")


def per_tensor_scale(config: FP8Config) -> Optional[int]:
    """The scale of the per-tensor casts: None (from the amax) for "amax", 0 for "static".
    The other recipes cast through :func:`~.recipe_linear.recipe_linear`."""
    if config.scaling not in ("amax", "static"):
        raise ValueError(f"scaling {config.scaling!r} casts through recipe_linear, not per "
                         "tensor here")
    return None if config.scaling == "amax" else 0


def cast_for_role(x: torch.Tensor, fmt: FP8Format, margin: int, config: FP8Config,
                  site: str) -> Fp8Tensor:
    """Cast with the config's scaling mode: AMAX with ``margin``, or static scale 0."""
    scale = per_tensor_scale(config)
    return cast_to_fp8(x, fmt, log2_scale=scale, margin=margin, overflow=config.overflow,
                       rounding=config.rounding, site=site)


def scaled_mm_supported(a: Fp8Tensor, b: Fp8Tensor) -> bool:
    """Whether ``torch._scaled_mm`` is used by default for this product.

    On CUDA only (on CPU the dequantised product is the reference), with OCP formats (the
    ones NVIDIA hardware has), not both E5M2, and inner/outer sizes that are multiples of 16.
    """
    if not hasattr(torch, "_scaled_mm") or a.codes.device.type != "cuda":
        return False
    if a.fmt.torch_dtype is None or b.fmt.torch_dtype is None:
        return False
    if {a.fmt.name, b.fmt.name} - {"E4M3FN", "E5M2"} or a.fmt.name == b.fmt.name == "E5M2":
        return False
    k, n = b.codes.shape
    return k % 16 == 0 and n % 16 == 0


def _power_of_two(log2_scale: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(math.ldexp(1.0, -log2_scale), dtype=torch.float32, device=device)


def fp8_tensor_matmul(a: Fp8Tensor, b: Fp8Tensor, dtype: torch.dtype,
                      use_scaled_mm: Optional[bool]) -> torch.Tensor:
    """The product of the values of two 2-D FP8 tensors, in ``dtype``."""
    if use_scaled_mm is None:
        use_scaled_mm = scaled_mm_supported(a, b)
    if use_scaled_mm:
        a_dtype, b_dtype = a.fmt.torch_dtype, b.fmt.torch_dtype
        if a_dtype is None or b_dtype is None or not hasattr(torch, "_scaled_mm"):
            raise RuntimeError("torch._scaled_mm or a float8 dtype is missing in this torch")
        left = a.codes.contiguous().view(a_dtype)
        right = b.codes.t().contiguous().view(b_dtype).t()  # column-major, as required
        out = torch._scaled_mm(
            left, right, scale_a=_power_of_two(a.log2_scale, left.device),
            scale_b=_power_of_two(b.log2_scale, left.device), out_dtype=torch.float32,
        )
        if isinstance(out, tuple):  # torch 2.1-2.3 also returned the output's amax
            out = out[0]
        return out.to(dtype)
    return cast_from_fp8(a, dtype) @ cast_from_fp8(b, dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def fp8_tensor_transpose(t: Fp8Tensor) -> Fp8Tensor:
    """A 2-D FP8 tensor transposed (a view of its codes; the same scale and format)."""
    return Fp8Tensor(t.codes.t(), t.log2_scale, t.fmt)


def _flatten(t: Fp8Tensor) -> Fp8Tensor:
    return Fp8Tensor(t.codes.reshape(-1, t.codes.shape[-1]), t.log2_scale, t.fmt)


_CAST_TO_FP8 = cast_to_fp8


def _casts_observed() -> bool:
    """Whether someone looks at the casts themselves: :func:`fp8_stats` records them, or this
    module's ``cast_to_fp8`` was replaced to see them (as tests of the PopXL model do)."""
    return stats_enabled() or cast_to_fp8 is not _CAST_TO_FP8


def values_for_role(x: torch.Tensor, fmt: FP8Format, margin: int, config: FP8Config,
                    site: str) -> torch.Tensor:
    """The FP8 values of ``x`` (float32) for one role of a matmul, with the config's scaling.

    Rounded straight to values where that gives the same bits, and recorded from them where
    :func:`fp8_stats` records the casts; through codes where something else watches the casts
    (a replaced ``cast_to_fp8``), the rounding is stochastic or the record needs the codes.
    """
    if config.rounding == "nearest" and (not _casts_observed() or _only_recorded(x)):
        scale = per_tensor_scale(config)
        values, used = quantise_values(x, fmt, scale, margin, config.overflow)
        # (figures from the values themselves: no codes to make and decode)
        if record_values(site, x, values, fmt, used):
            return values
    return cast_from_fp8(cast_for_role(x, fmt, margin, config, site), torch.float32)


def _only_recorded(x: torch.Tensor) -> bool:
    """Whether only :func:`fp8_stats` observes the casts, for a float32 ``x``, which
    :func:`~.stats.record_values` records."""
    return cast_to_fp8 is _CAST_TO_FP8 and x.dtype == torch.float32


class ValuesQuantiser:
    """An FP8 linear's casts of its GEMM operands, for eager forms that compute its GEMMs
    themselves (`fused_blocks.Quantiser`): ``quantiser(operand, role, transposed, out)``.
    ``native``: the same casts as the C++ nodes make them (`native_casts.layer_casts`), or
    None where those cannot make them, as where something observes the casts. Under the
    delayed recipe, ``history`` is the linear's amax history and ``update`` whether each cast
    pushes its operand's amax into it (as `recipe_linear.recipe_linear` casts)."""

    __slots__ = ("config", "site", "native", "history", "update")

    def __init__(self, config: FP8Config, site: str, history: Optional[torch.Tensor] = None,
                 update: bool = False) -> None:
        if config.scaling == "delayed" and history is None:
            raise ValueError("the delayed recipe's casts read an amax history: pass history")
        self.config, self.site, self.history, self.update = config, site, history, update
        self.native: Optional[Tuple[List[float], ...]] = None
        if not _casts_observed():
            from .native_casts import layer_casts

            scale = None if config.grouped or history is not None else per_tensor_scale(config)
            self.native = layer_casts(config, site, scale, self._cast_for, history, update)

    def __call__(self, t: torch.Tensor, role: str, transposed: bool,
                 out: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        config = self.config
        if self.history is not None:
            # `recipe_linear._RecipeLinear`'s delayed cast: the scale from the history before
            # this operand's amax enters it.
            scale = delayed_log2_scale(self.history, config, role)
            if self.update:
                push_amax(self.history, role, t)
            values = role_cast(t, config, role, f"{self.site}.{role}", scale).values
            return values, values if transposed else None
        if config.grouped:
            return grouped_operand_values(t, config, role, f"{self.site}.{role}", transposed,
                                          out)
        fmt, margin = {"input": (config.activation, config.activation_margin),
                       "weight": (config.weight, config.weight_margin),
                       "grad_output": (config.gradient, config.gradient_margin)}[role]
        values = values_for_role(t, fmt, margin, config, f"{self.site}.{role}")
        return values, values if transposed else None

    def _cast_for(self, role: str) -> Callable[
            [torch.Tensor, bool, Optional[torch.Tensor]],
            Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        return lambda t, transposed, out: self(t, role, transposed, out)


_ZERO = torch.zeros(())
_UNSCALED = (1.0, 1.0, 1.0, 1.0)


def _gemm(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * a @ b`` for 2-D float32 CPU operands, the scale inside the GEMM."""
    if alpha == 1.0:
        return a @ b
    return torch.addmm(_ZERO, a, b, beta=0, alpha=alpha)


class _FP8ValuesLinear(torch.autograd.Function):
    """The FP8 linear on FP8 values in float32 (CPU, float32 operands), with unit scaling's
    fixed scales ``(output, grad input, grad weight, grad bias)`` applied inside the GEMMs
    (all 1 for a plain FP8 linear). The backward pass keeps the rounded values."""

    @staticmethod
    def forward(ctx, x, weight, bias, config, site, scales):  # type: ignore[override]
        x_rows = x.reshape(-1, x.shape[-1])
        xq = values_for_role(x_rows, config.activation, config.activation_margin, config,
                             f"{site}.input")
        wq = values_for_role(weight, config.weight, config.weight_margin, config,
                             f"{site}.weight")
        y = _gemm(xq, wq.t(), scales[0])
        if bias is not None:
            y = y.add_(bias, alpha=scales[0])  # (before the output scale, as `U.linear`'s)
        ctx.save_for_backward(xq, wq)
        ctx.meta = (x.shape, bias is not None, config, site, scales)
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        x_shape, has_bias, config, site, scales = ctx.meta
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])
        gq = values_for_role(grad_rows, config.gradient, config.gradient_margin, config,
                             f"{site}.grad_output")
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _gemm(gq, wq, scales[1]).view(x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = _gemm(gq.t(), xq, scales[2])
        if has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
            grad_b = grad_b.mul_(scales[3]) if scales[3] != 1.0 else grad_b
        return grad_x, grad_w, grad_b, None, None, None


def values_path_applies(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        use_scaled_mm: Optional[bool]) -> bool:
    """Whether :class:`_FP8ValuesLinear` computes this FP8 linear: eager, on the CPU (where
    ``torch._scaled_mm`` is not used), with float32 tensors."""
    if use_scaled_mm or is_ipu_tracing() or x.device.type != "cpu":
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return all(t.dtype == torch.float32 for t in tensors) and x.dim() >= 2 and x.numel() > 0


def fp8_linear_values(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      config: FP8Config, site: str,
                      scales: Tuple[float, float, float, float] = _UNSCALED) -> torch.Tensor:
    """The FP8 linear on values (see :class:`_FP8ValuesLinear`, as a C++ node where
    :func:`native_linear` runs it); callers check :func:`values_path_applies` first."""
    y = native_linear(x, weight, bias, config, site, scales)
    return y if y is not None else _FP8ValuesLinear.apply(x, weight, bias, config, site, scales)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  config: FP8Config, site: str, scales: Tuple[float, float, float, float],
                  history: Optional[torch.Tensor] = None, update: bool = False
                  ) -> Optional[torch.Tensor]:
    """The FP8 linear on values as one C++ autograd node (`ops.native_layers`), casting
    with the kernels the Python Functions call, in their order, with their arguments (so
    with their values): :class:`_FP8ValuesLinear` per tensor, `recipe_linear`'s Function
    under the delayed (``history``, pushed into where ``update``) and grouped recipes. None
    where the node cannot run: it is not built or is off, the host library is missing, the
    casts are observed, or under a functorch transform. Callers check
    :func:`values_path_applies` first."""
    from ..ops import native_layers

    module = native_layers.usable()
    if module is None or _casts_observed():
        return None
    casts = ValuesQuantiser(config, site, history, update).native
    if casts is None:
        return None
    return module.fp8_linear(x, weight, bias, scales, casts, site)


class _FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, config, site, use_scaled_mm):  # type: ignore[override]
        compute = _compute_dtype(x)
        x8 = _flatten(cast_for_role(x, config.activation, config.activation_margin, config,
                                    f"{site}.input"))
        w8 = cast_for_role(weight, config.weight, config.weight_margin, config,
                           f"{site}.weight")
        y = fp8_tensor_matmul(x8, fp8_tensor_transpose(w8), compute, use_scaled_mm)
        if bias is not None:
            y = y + bias.to(compute)
        ctx.save_for_backward(x8.codes, w8.codes)
        ctx.meta = (x8.log2_scale, x8.fmt, w8.log2_scale, w8.fmt, x.shape, x.dtype,
                    weight.dtype, None if bias is None else bias.dtype)
        ctx.config, ctx.site, ctx.use_scaled_mm = config, site, use_scaled_mm
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        x_codes, w_codes = ctx.saved_tensors
        x_scale, x_fmt, w_scale, w_fmt, x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        config: FP8Config = ctx.config
        x8 = Fp8Tensor(x_codes, x_scale, x_fmt)
        w8 = Fp8Tensor(w_codes, w_scale, w_fmt)
        compute = torch.float64 if x_dtype == torch.float64 else torch.float32
        g8 = _flatten(cast_for_role(grad_output, config.gradient, config.gradient_margin,
                                    config, f"{ctx.site}.grad_output"))
        grad_x = grad_w = grad_b = None
        g8_t = fp8_tensor_transpose(g8)
        use_mm_x, use_mm_w = (
            ctx.use_scaled_mm if ctx.use_scaled_mm is not None else scaled_mm_supported(a, b)
            for a, b in ((g8, w8), (g8_t, x8))
        )
        # Both products read the output gradient: where they dequantise, decode it only once.
        g = cast_from_fp8(g8, compute) if not (use_mm_x and use_mm_w) else None
        if ctx.needs_input_grad[0]:
            grad_x = (
                fp8_tensor_matmul(g8, w8, compute, True) if use_mm_x or g is None
                else g @ cast_from_fp8(w8, compute)
            ).reshape(x_shape).to(x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (
                fp8_tensor_matmul(g8_t, x8, compute, True) if use_mm_w or g is None
                else g.t() @ cast_from_fp8(x8, compute)
            ).to(w_dtype)
        if b_dtype is not None and ctx.needs_input_grad[2]:
            flat = grad_output.reshape(-1, grad_output.shape[-1])
            grad_b = flat.to(compute).sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _traced_casts(config: FP8Config) -> Tuple[Optional[int], bool]:
    """(log2 scale or None for AMAX, saturate) of the custom ops for ``config``."""
    if config.rounding != "nearest":
        raise ValueError(
            "FP8 under ipu_tracing() rounds to nearest: the FP8 custom ops have no stochastic "
            "rounding (set rounding: nearest)")
    if config.scaling not in ("amax", "static"):
        raise ValueError(
            f"FP8 under ipu_tracing() casts per tensor (static or amax): the FP8 custom ops "
            f"have no {config.scaling!r} form")
    return per_tensor_scale(config), config.overflow == "saturate"


def _traced_fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       config: FP8Config) -> torch.Tensor:
    """The PopTorch form of :func:`fp8_linear`, from the FP8 custom ops and ordinary ops.

    The input and weight pass through ``fp8_quantise`` (its gradient is straight-through) and the
    product through ``fp8_quantise_gradient`` (identity forward; its gradient op quantises the
    output gradient), so PopART's autodiff computes the input and weight gradients from FP8
    values, as the eager form does. The bias joins after the gradient cast, so its gradient is
    the unquantised output gradient, also as in the eager form.
    """
    from .cast_ops import fp8_quantise, fp8_quantise_gradient

    scale, saturate = _traced_casts(config)
    x8 = fp8_quantise(x, config.activation, config.activation_margin, saturate, scale)
    w8 = fp8_quantise(weight, config.weight, config.weight_margin, saturate, scale)
    y = fp8_quantise_gradient(torch.nn.functional.linear(x8, w8), config.gradient,
                              config.gradient_margin, saturate, scale)
    return y if bias is None else y + bias


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[FP8Config] = None,
    site: str = "linear",
    use_scaled_mm: Optional[bool] = None,
    amax_history: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with FP8 casts of ``x``, ``weight`` and the output gradient.

    ``config`` defaults to ``FP8Config()`` (F143 forward, F152 gradients, AMAX scaling).
    ``site`` prefixes the names under which casts are recorded by :func:`fp8_stats`.
    ``use_scaled_mm``: None picks ``torch._scaled_mm`` where :func:`scaled_mm_supported`
    says so, True forces it (e.g. on CPU to compare), False always dequantises.
    The delayed and grouped recipes run :func:`~.recipe_linear.recipe_linear` (the delayed
    one with ``amax_history``, its state).
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight expects {weight.shape[-1]}")
    config = config or _DEFAULT_CONFIG
    if recipe_applies(config):  # (traced too: recipe_linear has its PopTorch form)
        return recipe_linear(x, weight, bias, config, site, amax_history=amax_history,
                             use_scaled_mm=use_scaled_mm)
    if is_ipu_tracing():
        return _traced_fp8_linear(x, weight, bias, config or _DEFAULT_CONFIG)
    if values_path_applies(x, weight, bias, use_scaled_mm):
        return fp8_linear_values(x, weight, bias, config or _DEFAULT_CONFIG, site)
    return _FP8LinearFunction.apply(x, weight, bias, config or _DEFAULT_CONFIG, site,
                                    use_scaled_mm)


class _FP8MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, config, site):  # type: ignore[override]
        compute = _compute_dtype(a)
        fmt = config.activation
        aq = _role_values(a, fmt, config.activation_margin, config, f"{site}.left", compute)
        bq = _role_values(b, fmt, config.activation_margin, config, f"{site}.right", compute)
        ctx.save_for_backward(aq, bq)
        ctx.meta = (a.dtype, b.dtype, compute)
        ctx.config, ctx.site = config, site
        return (aq @ bq).to(a.dtype)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        aq, bq = ctx.saved_tensors
        a_dtype, b_dtype, compute = ctx.meta
        config: FP8Config = ctx.config
        g = _role_values(grad_output, config.gradient, config.gradient_margin, config,
                         f"{ctx.site}.grad_output", compute)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _sum_to_shape(g @ bq.transpose(-1, -2), aq.shape).to(a_dtype)
        if ctx.needs_input_grad[1]:
            grad_b = _sum_to_shape(aq.transpose(-1, -2) @ g, bq.shape).to(b_dtype)
        return grad_a, grad_b, None, None


def _role_values(x: torch.Tensor, fmt: FP8Format, margin: int, config: FP8Config, site: str,
                 compute: torch.dtype) -> torch.Tensor:
    """FP8 values of ``x`` in ``compute``: the values path for float32 compute, else through
    codes (float64 compute keeps float64 products)."""
    if compute == torch.float32:
        return values_for_role(x, fmt, margin, config, site)
    return cast_from_fp8(cast_for_role(x, fmt, margin, config, site), compute)


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Undo matmul broadcasting of batch dimensions."""
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.shape[dim] != 1:
            grad = grad.sum(dim, keepdim=True)
    return grad


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, config: Optional[FP8Config] = None,
               site: str = "matmul") -> torch.Tensor:
    """``a @ b`` (batched, broadcasting) with both operands cast to the activation format and
    the output gradient to the gradient format, each with its own per-tensor scale."""
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError("fp8_matmul needs operands with at least 2 dimensions")
    config = config or _DEFAULT_CONFIG
    if recipe_applies(config):
        raise ValueError(f"fp8_matmul casts per tensor (static or amax), not with scaling "
                         f"{config.scaling!r}")
    if is_ipu_tracing():
        from .cast_ops import fp8_quantise, fp8_quantise_gradient

        scale, saturate = _traced_casts(config)
        a8 = fp8_quantise(a, config.activation, config.activation_margin, saturate, scale)
        b8 = fp8_quantise(b, config.activation, config.activation_margin, saturate, scale)
        return fp8_quantise_gradient(torch.matmul(a8, b8), config.gradient,
                                     config.gradient_margin, saturate, scale)
    return _FP8MatmulFunction.apply(a, b, config, site)


class FP8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run through FP8 casts (see :func:`fp8_linear`).

    ``site`` names this layer's casts in :func:`fp8_stats` records.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 config: Optional[FP8Config] = None, site: str = "linear",
                 device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config or _DEFAULT_CONFIG
        self.site = site
        self.use_scaled_mm: Optional[bool] = None
        self._add_recipe_state()

    def _add_recipe_state(self) -> None:
        """The delayed recipe's amax history, a buffer so that checkpoints keep it."""
        if self.config.scaling == "delayed":
            self.register_buffer("amax_history",
                                 new_amax_history(self.config, self.weight.device))

    def _valid_history(self) -> Optional[torch.Tensor]:
        """The delayed recipe's amax history where it has the shape the config asks for
        (else `recipe_linear` says what is wrong), else None."""
        history = getattr(self, "amax_history", None)
        expected = (3, self.config.amax_history_length)
        return history if history is not None and tuple(history.shape) == expected else None

    def _recipe_forward(self, x: torch.Tensor,
                        scales: Tuple[float, float, float, float] = _UNSCALED,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        history = getattr(self, "amax_history", None)
        update = self.training and torch.is_grad_enabled()
        weight = self.linear_weight()
        if (values_path_applies(x, weight, bias, self.use_scaled_mm)
                and (self.config.scaling != "delayed" or self._valid_history() is not None)):
            y = native_linear(x, weight, bias, self.config, self.site, scales, history, update)
            if y is not None:
                return y
        return recipe_linear(x, weight, bias, self.config, self.site, scales, history,
                             update_history=update, use_scaled_mm=self.use_scaled_mm)

    @classmethod
    def from_linear(cls: Type[_LinearT], linear: nn.Linear, config: Optional[FP8Config] = None,
                    site: str = "linear") -> _LinearT:
        """An FP8Linear sharing ``linear``'s parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias  # type: ignore[assignment]
        new.config = config or _DEFAULT_CONFIG
        new.site = site
        new.use_scaled_mm = None
        new._add_recipe_state()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if recipe_applies(self.config):
            return self._recipe_forward(x, bias=self.bias)
        return fp8_linear(x, self.linear_weight(), self.bias, self.config, self.site,
                          self.use_scaled_mm)

    def linear_weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it, (out_features, in_features); a layer that
        keeps it transposed (Hugging Face's ``Conv1D``) returns its transpose."""
        return self.weight

    def extra_repr(self) -> str:
        c = self.config
        return (f"{super().extra_repr()}, formats=({c.activation_format}, {c.weight_format}, "
                f"{c.gradient_format}), scaling={c.scaling}")


class FP8UnitScaledLinear(FP8Linear):
    """FP8 version of the unit-scaled ``uu.Linear``: same scales, FP8 casts in between.

    The casts see the unscaled input, weight and output gradient (all near unit variance in a
    unit-scaled model); the forward output scale is applied to the FP8 matmul's product and the
    backward scales of the input and weight to their gradients' products (inside the GEMMs,
    where the product is computed from FP8 values on the CPU).
    """

    constraint: Optional[str]
    # `U.linear`'s exponents: (1, 0.5, 0.5) for a `uu.LinearReadout`.
    scale_power: Tuple[float, float, float] = (0.5, 0.5, 0.5)
    # The `uu.Linear`'s `AttentionProjection`, if unit_scale marked it an attention projection.
    attention_projection: Any = None

    @classmethod
    def from_unit_scaled(cls, linear: nn.Linear, config: Optional[FP8Config] = None,
                         site: str = "linear") -> FP8UnitScaledLinear:
        new = cls.from_linear(linear, config, site)
        new.constraint = linear.constraint  # type: ignore[assignment]
        new.scale_power = getattr(linear, "scale_power", new.scale_power)
        new.attention_projection = getattr(linear, "attention_projection", None)
        return new

    def values_quantiser(self, x: torch.Tensor) -> Optional[ValuesQuantiser]:
        """For eager forms that compute this layer's GEMMs themselves (a GPT layer's
        two-Function form, `uu.TransformerBlock`): a function (operand, role, transposed,
        out) -> the FP8 values this layer's GEMMs would compute with, for role "input",
        "weight" or "grad_output": (those of the GEMM that reduces over the operand's last
        dimension, and where ``transposed`` those of the backward GEMM that reduces over its
        first, in the operand's shape; see `fused_blocks.Quantiser`). Per-tensor scaling
        rounds once for both; a grouped recipe casts along each dimension
        (`recipe_linear.grouped_operand_values`), the first into ``out`` where given; the
        delayed recipe casts per tensor with its amax history, pushed into in training as
        :meth:`forward` pushes. None where this layer does not compute on FP8 values in
        float32 for `x` (see `values_path_applies`), has a bias, or scales otherwise than
        `U.linear`."""
        if (self.bias is not None or tuple(self.scale_power) != (0.5, 0.5, 0.5)
                or self.attention_projection is not None
                or not values_path_applies(x, self.weight, None, self.use_scaled_mm)):
            return None
        history = self._valid_history()
        if self.config.scaling == "delayed" and history is None:
            return None
        return ValuesQuantiser(self.config, self.site, history,
                               self.training and torch.is_grad_enabled())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Imported here: the unit-scaled core imports nothing from fp8, and fp8 stays usable alone.
        from .. import ops as U
        from ..ops.scaling_primitive import scale_bwd, scale_fwd

        batch_size = max(1, x.numel() // x.shape[-1])
        output_scale, grad_input_scale, grad_weight_scale = U.linear_scales(
            self.in_features, self.out_features, batch_size, self.constraint, self.scale_power)
        # Its gradient is a sum over the batch: unit variance after 1/sqrt(batch).
        bias_scale = batch_size ** -0.5
        rule = self.attention_projection
        if rule is not None and x.dim() >= 2:
            grad_weight_scale *= rule.weight_grad_scale(x.shape[-2])
            bias_scale *= rule.bias_grad_scale(x.shape[-2])
        if recipe_applies(self.config):
            scales = (output_scale, grad_input_scale, grad_weight_scale, bias_scale)
            return self._recipe_forward(x, scales, self.bias)
        weight = self.linear_weight()
        if values_path_applies(x, weight, self.bias, self.use_scaled_mm):
            # One autograd node: the scales ride in the GEMMs around the FP8 values.
            scales = (output_scale, grad_input_scale, grad_weight_scale, bias_scale)
            return fp8_linear_values(x, weight, self.bias, self.config, self.site, scales)
        x = scale_bwd(x, grad_input_scale)
        weight = scale_bwd(weight, grad_weight_scale)
        y = fp8_linear(x, weight, None, self.config, self.site, self.use_scaled_mm)
        if self.bias is not None:
            y = y + scale_bwd(self.bias, bias_scale)
        return scale_fwd(y, output_scale)

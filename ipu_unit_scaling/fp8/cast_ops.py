"""The FP8 custom ops: quantise, and quantise the gradient, as single ops with their gradients.

PopTorch traces only the forward pass and lets PopART differentiate it, so an FP8 cast whose
gradient matters must be an op that carries its own gradient definition. Two ops do that, with
the same numerics everywhere they exist: the PopART ops built from ``custom_ops/`` (on the IPU,
through ``poptorch.custom_op``), and the ``torch.library`` ops registered here (on the CPU, in
the emulator, and under ``make_fx``, where each is one graph node).

``ipu_unit_scaling::fp8_quantise(x, format, margin, saturate, log2_scale)``
    ``decode(cast(x * 2**s)) * 2**-s`` in x's dtype and shape. ``s`` is ``log2_scale``, or
    ``clamp(floor(log2(fmt.max / amax)) - margin, -31, 31)`` from the tensor's amax (0 for an
    all-zero tensor). Gradient: straight through, ``dx = dy``.

``ipu_unit_scaling::fp8_quantise_gradient(x, format, margin, saturate, log2_scale=None)``
    The identity (a new tensor, never a view of x). Gradient: ``dx = fp8_quantise(dy, format,
    margin, saturate, log2_scale)``, itself one op: the scale from dy's amax, or the given one.

Formats are the codelets' F143 and F152; ``saturate`` chooses the overflow policy (+-max, or
NaN). A non-finite amax does not raise, as it cannot on the IPU: ``s = 0`` and the cast goes on
(NaN stays NaN, inf follows the policy), so the NaN reaches the loss and the training loop's NaN
check reports it. With a float16 input the result is rounded to float16 (to nearest even); it
can overflow to inf when the amax is within one FP8 step of float16's max.

The CPU kernel runs the codelets' code from the host library (``_fp8_host.so``) when it is
built, else :func:`fp8_quantise_reference`, which gives the same bits. Other devices use the
reference.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..ops import trace_switch as tracing
from ..ops.op_library import LIBRARY
from ..ops.op_library import below_autograd as _below_autograd
from .codec import FormatLike, decode, encode
from .fp8_formats import get_format
from .scaling import check_log2_scale, check_margin, log2_scale

__all__ = [
    "CODELET_FORMATS", "fp8_quantise", "fp8_quantise_gradient",
    "fp8_quantise_reference", "codelet_format",
]

CODELET_FORMATS = ("F143", "F152")
_DTYPES = (torch.float32, torch.float16)

_library = LIBRARY
_library.define(
    "fp8_quantise(Tensor x, str format, int margin, bool saturate, int? log2_scale) -> Tensor")
_library.define("fp8_quantise_gradient(Tensor x, str format, int margin, bool saturate, "
                "int? log2_scale=None) -> Tensor")


def codelet_format(fmt: FormatLike) -> str:
    """The name of ``fmt`` if the codelets implement it (F143, F152); ValueError otherwise."""
    name = get_format(fmt).name
    if name not in CODELET_FORMATS:
        raise ValueError(
            f"the FP8 custom ops implement {' and '.join(CODELET_FORMATS)} (the codelets' "
            f"formats), not {name}")
    return name


def _check_args(x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                scale: Optional[int]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"the FP8 custom ops take float32 or float16 tensors, not {x.dtype}")
    if fmt_name not in CODELET_FORMATS:
        raise ValueError(f"format must be one of {', '.join(CODELET_FORMATS)}, got {fmt_name!r}")
    check_margin(margin)
    if not isinstance(saturate, bool):
        raise ValueError(f"saturate must be a bool, got {saturate!r}")
    if scale is not None:
        check_log2_scale(scale)


def fp8_quantise_reference(x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                           scale: Optional[int]) -> Tuple[torch.Tensor, int, bool]:
    """Pure-torch quantise on any device: (values, s, whether the amax was non-finite).

    The same bits as the host library's kernel; the op's fallback where that is not built.
    """
    _check_args(x, fmt_name, margin, saturate, scale)
    x32 = x.detach().to(torch.float32)
    non_finite = False
    if scale is None:
        amax = float(x32.abs().max()) if x32.numel() else 0.0
        non_finite = not math.isfinite(amax)
        scale = 0 if non_finite else log2_scale(amax, fmt_name, margin)
    overflow = "saturate" if saturate else "nan"
    codes = encode(x32 * math.ldexp(1.0, scale), fmt_name, overflow=overflow)
    # decode(codes) has at most 4 significant bits and |s| <= 31: the multiply is exact.
    values = decode(codes, fmt_name) * math.ldexp(1.0, -scale)
    return values.to(x.dtype), scale, non_finite


def _host_quantise(x: torch.Tensor, fmt_name: str, margin: int, saturate: bool,
                   scale: Optional[int]) -> Optional[torch.Tensor]:
    """The host library's kernel (the codelets' code), or None where it does not apply."""
    if x.device.type != "cpu":
        return None
    from . import host_library as _host

    if not _host.fused_cast_available():
        return None
    values, _, _ = _host.fused_quantise(x.detach().contiguous(), fmt_name, scale, margin,
                                        saturate)
    return values


def _quantise_kernel(x: torch.Tensor, format: str, margin: int, saturate: bool,
                     log2_scale: Optional[int]) -> torch.Tensor:
    _check_args(x, format, margin, saturate, log2_scale)
    values = _host_quantise(x, format, margin, saturate, log2_scale)
    if values is None:
        values = fp8_quantise_reference(x, format, margin, saturate, log2_scale)[0]
    return values


def _quantise_meta(x: torch.Tensor, format: str, margin: int, saturate: bool,
                   log2_scale: Optional[int]) -> torch.Tensor:
    _check_args(x, format, margin, saturate, log2_scale)
    return torch.empty_like(x)


def _identity_kernel(x: torch.Tensor, format: str, margin: int, saturate: bool,
                     log2_scale: Optional[int] = None) -> torch.Tensor:
    _check_args(x, format, margin, saturate, log2_scale)
    return x.clone()


def _identity_meta(x: torch.Tensor, format: str, margin: int, saturate: bool,
                   log2_scale: Optional[int] = None) -> torch.Tensor:
    _check_args(x, format, margin, saturate, log2_scale)
    return torch.empty_like(x)


class _Quantise(torch.autograd.Function):
    """fp8_quantise's Autograd kernel: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, x, fmt_name, margin, saturate, scale):  # type: ignore[override]
        with _below_autograd():
            return torch.ops.ipu_unit_scaling.fp8_quantise(x, fmt_name, margin, saturate, scale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None, None, None


class _QuantiseGradient(torch.autograd.Function):
    """fp8_quantise_gradient's Autograd kernel: identity forward, quantised gradient."""

    @staticmethod
    def forward(ctx, x, fmt_name, margin, saturate, scale):  # type: ignore[override]
        ctx.cast = (fmt_name, margin, saturate, scale)
        with _below_autograd():
            return torch.ops.ipu_unit_scaling.fp8_quantise_gradient(x, fmt_name, margin,
                                                                    saturate, scale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dx = torch.ops.ipu_unit_scaling.fp8_quantise(grad, *ctx.cast)
        return dx, None, None, None, None


def _quantise_autograd(x: torch.Tensor, format: str, margin: int, saturate: bool,
                       log2_scale: Optional[int]) -> torch.Tensor:
    return _Quantise.apply(x, format, margin, saturate, log2_scale)


def _quantise_gradient_autograd(x: torch.Tensor, format: str, margin: int, saturate: bool,
                                log2_scale: Optional[int] = None) -> torch.Tensor:
    return _QuantiseGradient.apply(x, format, margin, saturate, log2_scale)


# CPU: the host library (or the reference); any other device: the reference, through
# CompositeExplicitAutograd; Meta: shapes only, for fake-tensor tracing.
_library.impl("fp8_quantise", _quantise_kernel, "CPU")
_library.impl("fp8_quantise", _quantise_kernel, "CompositeExplicitAutograd")
_library.impl("fp8_quantise", _quantise_meta, "Meta")
_library.impl("fp8_quantise", _quantise_autograd, "Autograd")
_library.impl("fp8_quantise_gradient", _identity_kernel, "CompositeExplicitAutograd")
_library.impl("fp8_quantise_gradient", _identity_meta, "Meta")
_library.impl("fp8_quantise_gradient", _quantise_gradient_autograd, "Autograd")


def _check_public(margin: int, saturate: bool, scale: Optional[int]) -> None:
    check_margin(margin)
    if not isinstance(saturate, bool):
        raise ValueError(f"saturate must be a bool, got {saturate!r}")
    if scale is not None:
        check_log2_scale(scale)


def fp8_quantise(x: torch.Tensor, fmt: FormatLike, margin: int = 0, saturate: bool = True,
                 log2_scale: Optional[int] = None) -> torch.Tensor:
    """``decode(cast(x * 2**s)) * 2**-s`` in x's dtype; the gradient passes straight through.

    ``fmt`` is F143 or F152 (a name or an :class:`FP8Format`); ``s`` is ``log2_scale``, or
    comes from x's amax with ``margin``; ``saturate`` sends overflow to +-max (else NaN). A
    non-finite amax gives ``s = 0`` instead of an error. Inside
    :func:`~ipu_unit_scaling.ops.trace_switch.ipu_tracing` with a custom-op implementation (the IPU
    backend's), that implementation runs; otherwise the ``torch.library`` op.
    """
    fmt_name = codelet_format(fmt)
    _check_public(margin, saturate, log2_scale)
    custom_ops = tracing.fp8_custom_ops()
    if custom_ops is not None:
        return custom_ops.quantise(x, fmt_name, margin, saturate, log2_scale)
    return torch.ops.ipu_unit_scaling.fp8_quantise(x, fmt_name, margin, saturate, log2_scale)


def fp8_quantise_gradient(x: torch.Tensor, fmt: FormatLike = "F152", margin: int = 3,
                          saturate: bool = True, log2_scale: Optional[int] = None
                          ) -> torch.Tensor:
    """The identity whose gradient is quantised:
    ``dx = fp8_quantise(dy, fmt, margin, saturate, log2_scale)``.

    The defaults are :class:`~ipu_unit_scaling.fp8.FP8Config`'s for gradients (F152, margin 3,
    AMAX scaling); ``log2_scale`` fixes the scale instead (0 for static scaling). Dispatches
    like :func:`fp8_quantise`.
    """
    fmt_name = codelet_format(fmt)
    _check_public(margin, saturate, log2_scale)
    custom_ops = tracing.fp8_custom_ops()
    if custom_ops is not None:
        return custom_ops.quantise_gradient(x, fmt_name, margin, saturate, log2_scale)
    return torch.ops.ipu_unit_scaling.fp8_quantise_gradient(x, fmt_name, margin, saturate,
                                                            log2_scale)

"""What GELU an IPU runs, for the constants of ``U.gelu`` in its PopTorch form.

PopTorch lowers both ``approximate`` values of ``aten::gelu`` to PopART's Gelu
(``popart_canonicalization/ActivationOps.cpp``, recorded in the PopTorch stand-in's lowering
table, generated from poptorch's source): the tanh approximation ``0.5 x (1 + tanh(a (x + b
x**3)))`` (``a = sqrt(2/pi)``, ``b = 0.044715``), whose gradient (popnn's GELU gradient) is
``0.5 (1 + tanh(a (x + b x**3)) + a x exp(-x**2/2))``: not the derivative of that forward, nor
of torch's erf form. The unit-scaling constants of ``U.gelu`` under ``ipu_tracing()`` are
those of this function (:func:`gelu_on_ipu`). A test holds :data:`GELU_ON_IPU` to the
stand-in's table and :func:`popart_gelu` to the stand-in's lowering.

Inside :func:`torch_numerics` ``U.gelu`` keeps torch's constants under ``ipu_tracing()``, and
the PopTorch stand-in computes each op as eager torch does: the traced forms can then be
checked against eager torch apart from what PopART computes differently.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "GELU_FORMS", "GELU_ON_IPU", "gelu_on_ipu", "gelu_of_form", "popart_gelu",
    "popart_gelu_slope", "torch_numerics", "follows_ipu_numerics",
]

# The GELUs that can run: torch's two forms, and PopART's Gelu (tanh forward, popnn's gradient).
GELU_FORMS = ("none", "tanh", "popart")
# aten::gelu's `approximate` -> the GELU form an IPU runs for it (PopART's Gelu for both).
GELU_ON_IPU: Dict[str, str] = {"none": "popart", "tanh": "popart"}

_ALPHA = math.sqrt(2.0 / math.pi)
_BETA = 0.044715

_torch_numerics_depth = [0]


@contextlib.contextmanager
def torch_numerics() -> Iterator[None]:
    """Inside this context ``U.gelu`` keeps torch's constants under ``ipu_tracing()`` and the
    PopTorch stand-in, where it is loaded, computes each op as eager torch defines it. For
    checking the traced forms against eager torch."""
    from ipu_standins.poptorch_settings import torch_numerics as standin_torch_numerics

    with standin_torch_numerics():
        _torch_numerics_depth[0] += 1
        try:
            yield
        finally:
            _torch_numerics_depth[0] -= 1


def follows_ipu_numerics() -> bool:
    """Whether the PopTorch forms use what an IPU computes (outside :func:`torch_numerics`)."""
    return _torch_numerics_depth[0] == 0


def gelu_on_ipu(approximate: str) -> str:
    """The GELU form (one of :data:`GELU_FORMS`) an IPU runs for ``aten::gelu(approximate)``."""
    form = GELU_ON_IPU.get(approximate)
    if form is None:
        raise ValueError(f"approximate={approximate!r}: PopTorch lowers GELU only for "
                         f"{', '.join(sorted(GELU_ON_IPU))}")
    return form


def popart_gelu_slope(x: Tensor) -> Tensor:
    """The factor PopART's GeluGrad multiplies the output gradient by, popnn's GELU gradient:
    ``0.5 (1 + tanh(a (x + b x**3)) + a x exp(-x**2/2))``, ``a = sqrt(2/pi)``, ``b = 0.044715``,
    with x clamped to +-12 (+-6 for half) as the codelets do, in float32 at least."""
    limit = 6.0 if x.dtype == torch.float16 else 12.0
    z = x.to(torch.promote_types(x.dtype, torch.float32)).clamp(-limit, limit)
    slope = 0.5 * (1.0 + torch.tanh(_ALPHA * (z + _BETA * z * z * z))
                   + _ALPHA * z * torch.exp(-0.5 * z * z))
    return slope.to(x.dtype)


class _PopARTGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad * popart_gelu_slope(x)


def popart_gelu(x: Tensor) -> Tensor:
    """PopART's Gelu: torch's tanh-approximate GELU forward, :func:`popart_gelu_slope` as its
    gradient."""
    return _PopARTGelu.apply(x)


def gelu_of_form(x: Tensor, form: str) -> Tensor:
    """The GELU ``form`` (one of :data:`GELU_FORMS`) of ``x``, with that form's gradient."""
    if form == "popart":
        return popart_gelu(x)
    return F.gelu(x, approximate=form)

"""What an IPU computes where PopTorch's lowering departs from eager torch, and how the stand-in
computes the same.

:mod:`._lowering_table`, generated from poptorch's source by ``scripts/poptorch_lowering.py``,
records for every ATen op the traced models of the project's tests reach which PopART ops
PopTorch lowers it to and whether PopART then computes what eager torch computes. Two rows
change numbers:

- ``aten::gelu`` (``differs``): both ``approximate`` values are lowered to PopART's Gelu, the
  tanh approximation ``0.5 x (1 + tanh(a (x + b x**3)))`` (``a = sqrt(2/pi)``, ``b =
  0.044715``), whose gradient (popnn's GELU gradient) is ``0.5 (1 + tanh(a (x + b x**3)) + a x
  exp(-x**2/2))``: not the derivative of that forward, nor of torch's erf form.
- ``aten::_to_copy`` (``stochastic-rounding``): with ``Precision.enableStochasticRounding`` a
  float-to-half cast rounds stochastically, in the forward pass and, for a half-to-float cast,
  in the gradient.

:func:`lower_graph` rewrites a graph traced like PopTorch (:mod:`._tracer`) to compute these,
except inside :func:`ipu_standins.poptorch_settings.torch_numerics`. Dropout (``random``) keeps
torch's random draw: the IPU's generator is not reproduced.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from ..poptorch_settings import follows_ipu_numerics
from ._lowering_table import GELU_LOWERING

__all__ = [
    "GELU_FORMS", "gelu_on_ipu", "gelu_of_form", "popart_gelu", "popart_gelu_slope",
    "stochastic_round_to_half", "stochastic_cast", "lower_graph", "REWRITTEN_OPS",
]

# The GELUs that can run: torch's two forms, and PopART's Gelu (tanh forward, popnn's gradient).
GELU_FORMS = ("none", "tanh", "popart")
# What each PopART op geluHandler can build computes, as a form above.
_POPART_GELU_FORMS = {"Gelu": "popart", "GeluErf": "none"}

_ALPHA = math.sqrt(2.0 / math.pi)
_BETA = 0.044715

def gelu_on_ipu(approximate: str) -> str:
    """The GELU form (one of :data:`GELU_FORMS`) an IPU runs for ``aten::gelu(approximate)``."""
    op = GELU_LOWERING.get(approximate)
    if op is None:
        raise ValueError(f"approximate={approximate!r}: PopTorch lowers GELU only for "
                         f"{', '.join(sorted(GELU_LOWERING))}")
    return _POPART_GELU_FORMS[op]


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


def stochastic_round_to_half(x: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """``x`` (float32 or float64) rounded to float16 stochastically: to the float16 value below
    or above it, the one above with probability ``(x - below) / (above - below)``, so that the
    mean is ``x``. Values float16 holds, infinities and NaN are cast as they are. Past 65504 the
    value above is infinity, counted as 65536 in the probability."""
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"stochastic rounding to half takes float32 or float64, not {x.dtype}")
    magnitude = x.abs()
    nearest = magnitude.to(torch.float16)
    nearest_bits = nearest.view(torch.int16)
    # Positive float16 bit patterns count up with the value: the neighbours are one apart.
    below_bits = torch.where(nearest.to(x.dtype) > magnitude, nearest_bits - 1, nearest_bits)
    above_bits = below_bits + 1
    below = below_bits.view(torch.float16).to(x.dtype)
    above = above_bits.view(torch.float16).to(x.dtype)
    above = torch.where(torch.isinf(above), torch.full_like(above, 65536.0), above)
    # Both differences are exact: below is within one float16 step of magnitude.
    probability_above = (magnitude - below) / (above - below)
    draw = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    rounded = torch.where(draw < probability_above, above_bits, below_bits).view(torch.float16)
    rounded = torch.where(x < 0, -rounded, rounded)
    kept = (nearest.to(x.dtype) == magnitude) | ~torch.isfinite(x)
    return torch.where(kept, x.to(torch.float16), rounded)


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype == torch.float16 and x.dtype in (torch.float32, torch.float64):
        return stochastic_round_to_half(x)
    return x.to(dtype)


class _StochasticCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.source_dtype = x.dtype
        return _cast(x, dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        return _cast(grad, ctx.source_dtype), None


def stochastic_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)`` as an IPU casts with stochastic rounding on: a cast to float16 rounds
    stochastically, and so does the gradient of a cast from float16."""
    return _StochasticCast.apply(x, dtype)


# The ops of the lowering table whose verdict is neither "same" nor one the emulator leaves to
# torch ("random": the IPU's generator; "constant": folded to the same values).
REWRITTEN_OPS = frozenset(("gelu", "_to_copy"))

_LOWERED_GELU: Dict[str, Callable[[Tensor], Tensor]] = {
    "popart": popart_gelu,
    "none": F.gelu,
}
_HALF_CASTS = {frozenset((torch.float16, torch.float32)), frozenset((torch.float16, torch.float64))}


def _dtype_of(node: Any) -> Optional[torch.dtype]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(value, "dtype", None)


def lower_graph(graph: fx.GraphModule, stochastic_rounding: bool = False) -> fx.GraphModule:
    """Rewrite ``graph`` (ATen ops traced like PopTorch, with ``meta["val"]`` on its nodes) to
    compute what an IPU computes: ``aten::gelu`` as PopTorch lowers it and, with
    ``stochastic_rounding``, casts between float and half rounded stochastically both ways.
    Returns ``graph``, rewritten in place; unchanged inside
    :func:`ipu_standins.poptorch_settings.torch_numerics`."""
    if not follows_ipu_numerics():
        return graph
    changed = False
    for node in graph.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" \
            else None
        if packet is torch.ops.aten.gelu:
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1
                                          else "none")
            node.target = _LOWERED_GELU[gelu_on_ipu(approximate)]
            node.args, node.kwargs = (node.args[0],), {}
            changed = True
        elif stochastic_rounding and packet is torch.ops.aten._to_copy:
            source, target = _dtype_of(node.args[0]), node.kwargs.get("dtype")
            if frozenset((source, target)) in _HALF_CASTS:
                node.target = stochastic_cast
                node.args, node.kwargs = (node.args[0], target), {}
                changed = True
    if changed:
        graph.recompile()
    return graph

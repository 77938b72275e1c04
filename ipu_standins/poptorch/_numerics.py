"""Where the stand-in's numerics follow an IPU option rather than eager torch.

- ``Precision.setPartialsType(torch.half)``: a float16 matmul accumulates its partial sums in
  float16. The stand-in sums the products of the reduced dimension one at a time, rounding
  each running sum to float16 (each product is exact in float32). With float partials (the
  default) a float16 matmul accumulates in float32 and rounds once to float16: the stand-in
  computes it in float32 and casts the result (torch's own float16 matmul on a CPU does the
  same arithmetic, much more slowly).
- ``useIpuModel(True)``: the IPU Model runs popnn's C++ GELU codelet, whose gradient is the
  exact derivative of the tanh-form forward (``NonLinearity.hpp``); hardware runs the assembly
  codelet's formula, which the stand-in's lowering computes (:func:`._lowering.popart_gelu`).
  Without ``useIpuModel`` the hardware form runs.
- Float16 ops that torch's CPU has no kernel for (GELU and others on torch 2.0.1): an IPU
  computes them in float16; the stand-in computes them in float32 and rounds the result to
  float16 (:class:`HalfKernels`), which is what an IPU's float16 op with float32 internals
  returns, within one float16 rounding.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ._lowering import popart_gelu

__all__ = ["apply", "half_partials_matmul", "ipu_model_gelu", "HalfKernels"]


def _to_float(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and (
        value.dtype == torch.float16) else value


def _to_half(value: Any) -> Any:
    return value.half() if isinstance(value, torch.Tensor) and (
        value.dtype == torch.float32) else value


class HalfKernels(TorchDispatchMode):
    """Runs a float16 op that torch's CPU lacks a kernel for in float32, rounding its float32
    results back to float16; every other op runs as it is."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as error:
            if "'Half'" not in str(error):
                raise
        out = func(*tree_map(_to_float, args), **tree_map(_to_float, kwargs))
        flat = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if any(v.dtype == torch.float32 for v in flat):
            return out  # float32 inputs too: the op's result is float32 as it is
        return tree_map(_to_half, out)

    @staticmethod
    def needed(tensors: Any) -> bool:
        """Whether any of ``tensors`` is float16 (the mode costs a Python call per op)."""
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.float16 for t in tensors)


def half_partials_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (float16, ``[..., m, k] @ [..., k, n]``) with float16 partial sums."""
    total: Optional[torch.Tensor] = None
    for index in range(a.shape[-1]):
        term = (a[..., index:index + 1].float() * b[..., index:index + 1, :].float())
        total = term.half() if total is None else (total.float() + term).half()
    assert total is not None
    return total


def _float_partials_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.float(), b.float()).half()


def _float_partials_addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any = 1,
                          alpha: Any = 1) -> torch.Tensor:
    return torch.addmm(bias.float(), a.float(), b.float(), beta=beta, alpha=alpha).half()


class _HalfMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return half_partials_matmul(a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        a, b = ctx.saved_tensors
        return (half_partials_matmul(grad, b.transpose(-1, -2)),
                half_partials_matmul(a.transpose(-1, -2), grad))


def _mm_autograd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _HalfMatmul.apply(a, b)


def _addmm_autograd(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any = 1,
                    alpha: Any = 1) -> torch.Tensor:
    product = _HalfMatmul.apply(a, b)
    return (beta * bias + alpha * product).half()


def ipu_model_gelu(x: torch.Tensor) -> torch.Tensor:
    """The IPU Model's GELU: the tanh form and its exact derivative."""
    return F.gelu(x, approximate="tanh")


def _is_half(node: Any) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(value, "dtype", None) == torch.float16


def apply(graph: fx.GraphModule, half_partials: bool, ipu_model: bool) -> None:
    changed = False
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if ipu_model and node.target is popart_gelu:
            node.target = ipu_model_gelu
            changed = True
        packet = getattr(node.target, "overloadpacket", None)
        if packet in (torch.ops.aten.mm, torch.ops.aten.bmm) and all(
                _is_half(a) for a in node.args[:2]):
            node.target = _mm_autograd if half_partials else _float_partials_mm
            changed = True
        elif packet is torch.ops.aten.addmm and all(_is_half(a) for a in node.args[:3]):
            node.target = _addmm_autograd if half_partials else _float_partials_addmm
            node.args = tuple(node.args[:3]) + tuple(
                node.kwargs.get(k, node.args[i] if len(node.args) > i else 1)
                for i, k in ((3, "beta"), (4, "alpha")))
            node.kwargs = {}
            changed = True
    if changed:
        graph.recompile()

"""Where the stand-in's numerics follow an IPU option rather than eager torch.

- ``Precision.setPartialsType(torch.half)``: float16 matmuls and convolutions (the option sets
  both, as PopTorch's does) accumulate their partial sums in float16. The stand-in's model of
  that rounding: the reduced dimension is cut into blocks of ``PARTIALS_BLOCK`` (16)
  consecutive elements (a convolution's: 16 input channels, with the whole kernel window);
  each block's sum of products is computed in float32 (float16 products are exact there) and
  rounded once to float16; then the block sums are added pairwise, as a tree, each addition
  rounded to float16. Its error is at most about ``(ceil(log2(blocks)) + 1)`` float16
  roundings of the sum of the products' magnitudes (plus ``16`` float32 roundings), where
  float partials round once. The block size is the stand-in's choice, not a measured property
  of the IPU's AMP units. A convolution's backward pass keeps float partials. With float
  partials (the default) a float16 matmul accumulates in float32 and rounds once to float16:
  the stand-in computes it in float32 and casts the result (torch's own float16 matmul on a
  CPU does the same arithmetic, much more slowly).
- ``useIpuModel(True)``: the IPU Model runs popnn's C++ GELU codelet, whose gradient is the
  exact derivative of the tanh-form forward (``NonLinearity.hpp``); hardware runs the assembly
  codelet's formula, which the stand-in's lowering computes (:func:`._lowering.popart_gelu`).
  Without ``useIpuModel`` the hardware form runs.
- ``_Popart.set("groupNormStridedChannelGrouping", True)``: poplibs' fast group norm puts
  channel ``c`` in group ``c % groups`` rather than ``c // (channels / groups)`` (PopART's
  ``groupnorm_test.py`` reference reorders the channels the same way); the affine weight and
  bias stay per channel.
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

__all__ = ["apply", "half_partials_matmul", "half_partials_convolution", "ipu_model_gelu",
           "strided_group_norm", "HalfKernels", "PARTIALS_BLOCK"]


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


PARTIALS_BLOCK = 16  # products summed in float32 before a float16 partial sum
_PARTIALS_BYTES = 1 << 26  # float32 block sums held at once (64 MiB)


def _tree_sum_half(parts: torch.Tensor) -> torch.Tensor:
    """Sum float16 ``parts`` over dim 0 pairwise, each addition rounded to float16."""
    while parts.shape[0] > 1:
        if parts.shape[0] % 2:
            parts = torch.cat([parts, torch.zeros_like(parts[:1])])
        parts = (parts[0::2].float() + parts[1::2].float()).half()
    return parts[0]


def half_partials_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (float16, ``[..., m, k] @ [..., k, n]``) with float16 partial sums: blocks of
    ``PARTIALS_BLOCK`` products summed in float32 and rounded to float16, the block sums added
    as a tree in float16 (see the module's docstring)."""
    k = a.shape[-1]
    blocks = -(-k // PARTIALS_BLOCK)
    pad = blocks * PARTIALS_BLOCK - k  # zero products add nothing
    # [..., m, k] -> [blocks, ..., m, B]; [..., k, n] -> [blocks, ..., n, B] (b is often a
    # transposed weight: its transpose is then contiguous, and cheap to cast and pad)
    a_blocks = F.pad(a.float(), (0, pad)).reshape(
        *a.shape[:-1], blocks, PARTIALS_BLOCK).movedim(-2, 0)
    b_blocks = F.pad(b.transpose(-1, -2).float(), (0, pad)).reshape(
        *b.shape[:-2], b.shape[-1], blocks, PARTIALS_BLOCK).movedim(-2, 0)
    per_block = 4 * a.shape[-2] * b.shape[-1] * max(1, a[..., 0, 0].numel())
    step = max(1, _PARTIALS_BYTES // per_block)
    sums = [torch.matmul(a_blocks[i:i + step], b_blocks[i:i + step].transpose(-1, -2)).half()
            for i in range(0, blocks, step)]
    return _tree_sum_half(torch.cat(sums) if len(sums) > 1 else sums[0])


def half_partials_convolution(x: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any,
                              dilation: Any, groups: int) -> torch.Tensor:
    """A float16 convolution (not transposed, no bias) with float16 partial sums: blocks of
    ``PARTIALS_BLOCK`` input channels of each group convolved in float32 (the kernel window
    with them) and rounded to float16, the block results added as a tree in float16."""
    per_group = weight.shape[1]
    parts = []
    for start in range(0, per_group, PARTIALS_BLOCK):
        stop = min(start + PARTIALS_BLOCK, per_group)
        channels = [g * per_group + c for g in range(groups) for c in range(start, stop)]
        part = torch.ops.aten.convolution(
            x[:, channels].float(), weight[:, start:stop].float(), None, stride, padding,
            dilation, False, [0] * (weight.dim() - 2), groups)
        parts.append(part.half())
    return _tree_sum_half(torch.stack(parts))


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


class _HalfConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                stride: Any, padding: Any, dilation: Any, groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.settings = (stride, padding, dilation, groups)
        out = half_partials_convolution(x, weight, stride, padding, dilation, groups)
        if bias is not None:
            shape = [1, -1] + [1] * (out.dim() - 2)
            out = (out.float() + bias.float().reshape(shape)).half()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight, bias = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.settings
        inputs = [t.detach().float().requires_grad_() if t is not None else None
                  for t in (x, weight, bias)]
        with torch.enable_grad():
            out = torch.ops.aten.convolution(inputs[0], inputs[1], inputs[2], stride, padding,
                                             dilation, False, [0] * (weight.dim() - 2), groups)
            wanted = [t for t in inputs if t is not None]
            grads = iter(torch.autograd.grad(out, wanted, grad.float()))
        found = [next(grads).half() if t is not None else None for t in inputs]
        return (*found, None, None, None, None)


def _convolution_autograd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          stride: Any, padding: Any, dilation: Any, transposed: bool,
                          output_padding: Any, groups: int) -> torch.Tensor:
    if transposed:  # the stand-in models half partials for forward convolutions only
        return torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, transposed,
                                          output_padding, groups)
    return _HalfConvolution.apply(x, weight, bias, stride, padding, dilation, groups)


def _mm_autograd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _HalfMatmul.apply(a, b)


def _addmm_autograd(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any = 1,
                    alpha: Any = 1) -> torch.Tensor:
    product = _HalfMatmul.apply(a, b)
    return (beta * bias + alpha * product).half()


def ipu_model_gelu(x: torch.Tensor) -> torch.Tensor:
    """The IPU Model's GELU: the tanh form and its exact derivative."""
    return F.gelu(x, approximate="tanh")


def strided_group_norm(x: torch.Tensor, weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], n: int, c: int, hxw: int, groups: int,
                       eps: float) -> Any:
    """``aten.native_group_norm`` with channel ``c`` in group ``c % groups``."""
    size = c // groups
    # Gather each strided group's channels together, normalise, then put them back.
    gathered = x.reshape(n, size, groups, -1).transpose(1, 2).reshape(n, c, -1)
    out, mean, rstd = torch.ops.aten.native_group_norm(gathered, None, None, n, c, hxw, groups,
                                                       eps)
    out = out.reshape(n, groups, size, -1).transpose(1, 2).reshape(n, c, -1)
    if weight is not None:
        out = out * weight.reshape(1, c, 1)
    if bias is not None:
        out = out + bias.reshape(1, c, 1)
    return out.reshape(x.shape), mean, rstd


def _is_half(node: Any) -> bool:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(value, "dtype", None) == torch.float16


def apply(graph: fx.GraphModule, half_partials: bool, ipu_model: bool,
          half_conv_partials: bool = False, strided_groups: bool = False) -> None:
    """Rewrite ``graph`` for the IPU's numerics: half partials for float16 matmuls
    (``half_partials``) and convolutions (``half_conv_partials``), the IPU Model's GELU,
    group norms' strided channel grouping (``strided_groups``)."""
    changed = False
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if ipu_model and node.target is popart_gelu:
            node.target = ipu_model_gelu
            changed = True
        packet = getattr(node.target, "overloadpacket", None)
        if strided_groups and packet is torch.ops.aten.native_group_norm:
            node.target = strided_group_norm
            changed = True
        if packet in (torch.ops.aten.mm, torch.ops.aten.bmm) and all(
                _is_half(a) for a in node.args[:2]):
            node.target = _mm_autograd if half_partials else _float_partials_mm
            changed = True
        elif packet is torch.ops.aten.convolution and half_conv_partials and all(
                _is_half(a) for a in node.args[:2]):
            node.target = _convolution_autograd
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

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

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import fx
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
)
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
_TILE_BYTES = 1 << 22  # float32 block sums held at once (4 MiB), their buffers reused by the tiles


@contextlib.contextmanager
def _outside_half_kernels() -> Iterator[None]:
    """Every op of the half partials has a CPU kernel (float32 ops, casts, float16 additions
    where torch has them): they skip :class:`HalfKernels`' Python call per op, which costs
    more than most of the ops."""
    if isinstance(_get_current_dispatch_mode(), HalfKernels):
        with _pop_mode_temporarily():
            yield
    else:
        yield


def _adds_float16() -> bool:
    """Whether torch adds float16 tensors on a CPU (before torch 2.1 some builds do not)."""
    try:
        torch.add(torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.float16))
    except (RuntimeError, NotImplementedError):
        return False
    return True


_ADDS_FLOAT16 = _adds_float16()


def _add_rounded(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x + y``, float16, rounded once.

    Torch adds float16 in float32 (or in float16) and rounds once; float32 holds more than
    twice float16's precision, so either gives the correctly rounded float16 sum, as does a
    float32 addition rounded to float16 where torch has no float16 addition."""
    if _ADDS_FLOAT16:
        torch.add(x, y, out=out)
    else:
        out.copy_(torch.add(x.float(), y.float()))


def _tree_sum(sums: torch.Tensor, out: torch.Tensor) -> None:
    """Add float16 block sums (dim 0, at least 2) pairwise, as a tree, into ``out``: a level of
    odd length adds ``+0`` to its last element. Each level goes into the front of a buffer of
    its own (two buffers, in turn)."""
    spare: Optional[torch.Tensor] = None
    while sums.shape[0] > 2:
        pairs, odd = divmod(sums.shape[0], 2)
        if spare is None:
            spare = torch.empty_like(sums[:pairs + odd])
        level = spare[:pairs + odd]
        _add_rounded(sums[0:2 * pairs:2], sums[1:2 * pairs:2], level[:pairs])
        if odd:  # (x + 0 is x, except that -0 + 0 is +0)
            _add_rounded(sums[-1:], torch.zeros((), dtype=sums.dtype), level[pairs:])
        sums, spare = level, sums
    _add_rounded(sums[0], sums[1], out)


def _float32_padded(x: torch.Tensor, dim: int, pad: int) -> torch.Tensor:
    """``x`` (``[count, rows, cols]``) in float32 with ``pad`` zeros after the end of its dim
    ``dim`` (1 or 2), in one fresh buffer laid out as ``x`` is: a transposed operand stays
    transposed, so that the copy reads it in memory order."""
    if not pad:
        return x.float()  # (which keeps x's layout)
    if x.stride(1) == 1 and x.stride(2) != 1:
        return _float32_padded(x.transpose(1, 2), 3 - dim, pad).transpose(1, 2)
    shape = list(x.shape)
    shape[dim] += pad
    out = torch.empty(shape)
    out.narrow(dim, x.shape[dim], pad).zero_()
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


def half_partials_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (float16, ``[..., m, k] @ [..., k, n]``) with float16 partial sums: blocks of
    ``PARTIALS_BLOCK`` products summed in float32 and rounded to float16, the block sums added
    as a tree in float16 (see the module's docstring)."""
    k, m, n = a.shape[-1], a.shape[-2], b.shape[-1]
    blocks = max(1, -(-k // PARTIALS_BLOCK))
    pad = blocks * PARTIALS_BLOCK - k  # zero products (+0) add nothing
    batch = a.shape[:-2]
    if b.shape[:-2] != batch:
        batch = torch.broadcast_shapes(batch, b.shape[:-2])
        a, b = a.expand(*batch, m, k), b.expand(*batch, k, n)
    count = batch.numel()
    with _outside_half_kernels():
        # Float32 copies laid out as the operands are: bmm reads a transposed one as it lies.
        a32 = _float32_padded(a.reshape(count, m, k), 2, pad)
        b32 = _float32_padded(b.reshape(count, k, n), 1, pad)
        if blocks == 1:
            return torch.bmm(a32, b32).half().view(*batch, m, n)
        if count == 1:  # the blocks as one batch of views: [blocks, m, B] @ [blocks, B, n]
            a_blocks = a32[0].reshape(m, blocks, PARTIALS_BLOCK).movedim(1, 0)
            b_blocks = b32[0].reshape(blocks, PARTIALS_BLOCK, n)
        out = torch.empty((count, m, n), dtype=torch.float16)
        # A tile of output rows at a time: at most _TILE_BYTES of block sums, buffers reused.
        rows = max(1, min(m, _TILE_BYTES // (4 * blocks * max(1, count * n))))
        for start in range(0, m, rows):
            stop = min(start + rows, m)
            if start == 0 or stop - start != rows:
                sums32 = torch.empty((blocks, count, stop - start, n))
                sums = torch.empty((blocks, count, stop - start, n), dtype=torch.float16)
            if count == 1:
                torch.bmm(a_blocks[:, start:stop], b_blocks, out=sums32[:, 0])
            else:  # a bmm a block (making the blocks one batch would copy both operands)
                for block in range(blocks):
                    cut = slice(block * PARTIALS_BLOCK, (block + 1) * PARTIALS_BLOCK)
                    torch.bmm(a32[:, start:stop, cut], b32[:, cut], out=sums32[block])
            sums.copy_(sums32)
            _tree_sum(sums, out[:, start:stop])
        return out.view(*batch, m, n)


def half_partials_convolution(x: torch.Tensor, weight: torch.Tensor, stride: Any, padding: Any,
                              dilation: Any, groups: int) -> torch.Tensor:
    """A float16 convolution (not transposed, no bias) with float16 partial sums: blocks of
    ``PARTIALS_BLOCK`` input channels of each group convolved in float32 (the kernel window
    with them) and rounded to float16, the block results added as a tree in float16."""
    settings = (stride, padding, dilation, False, [0] * (weight.dim() - 2), groups)
    per_group = weight.shape[1]
    blocks = -(-per_group // PARTIALS_BLOCK)
    sums: Optional[torch.Tensor] = None
    with _outside_half_kernels():
        # Each group's channels side by side: a block's are a slice of the per-group channels.
        by_group = x.reshape(x.shape[0], groups, per_group, *x.shape[2:])
        # A convolution a block (as fast on a CPU as one grouped convolution of them all).
        for index, start in enumerate(range(0, per_group, PARTIALS_BLOCK)):
            stop = min(start + PARTIALS_BLOCK, per_group)
            part = torch.ops.aten.convolution(
                by_group[:, :, start:stop].reshape(x.shape[0], -1, *x.shape[2:]).float(),
                weight[:, start:stop].float(), None, *settings)
            if blocks == 1:
                return part.half()
            if sums is None:
                sums = torch.empty((blocks, *part.shape), dtype=torch.float16)
            sums[index].copy_(part)
        assert sums is not None
        out = torch.empty(sums.shape[1:], dtype=torch.float16)
        _tree_sum(sums, out)
        return out


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
        wants_a, wants_b = ctx.needs_input_grad[:2]
        return (half_partials_matmul(grad, b.transpose(-1, -2)) if wants_a else None,
                half_partials_matmul(a.transpose(-1, -2), grad) if wants_b else None)


class _HalfConvolution(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                stride: Any, padding: Any, dilation: Any, groups: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.settings = (stride, padding, dilation, groups)
        out = half_partials_convolution(x, weight, stride, padding, dilation, groups)
        if bias is not None:
            with _outside_half_kernels():
                shape = [1, -1] + [1] * (out.dim() - 2)
                out = (out.float() + bias.float().reshape(shape)).half()
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight, bias = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.settings
        inputs = [t.detach().float().requires_grad_() if t is not None else None
                  for t in (x, weight, bias)]
        with torch.enable_grad(), _outside_half_kernels():
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
    # A float16 product by 1 is exact: skipping it changes no bit and saves two ops.
    return ((bias if beta == 1 else beta * bias) + (product if alpha == 1 else alpha * product)
            ).half()


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

"""``popxl.ops``: the ``popxl.ops`` subset the PopXL model uses, in torch.

Each op cites the file of Graphcore's ``popart`` repository whose docstring (and, where the
docstring is silent, C++ op) it follows; paths are relative to ``python/popxl/python_files/ops/``
unless they say otherwise. See :mod:`ipu_standins.popxl` for what this is.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from ..popxl_settings import fp8_matmul_output_dtype
from . import _core as _r
from ._core import (  # popxl.ops has these too: Tensor's operators use them
    Run,
    Tensor,
    Variable,
    add,
    add_op,
    add_stateful_op,
    detach,
    div,
    matmul,
    mul,
    negate,
    reshape,
    same_dtype,
    sub,
    transpose,
)
from ._float8 import decode, encode

__all__ = [
    "CallSiteInfo", "call", "call_with_info", "add", "sub", "mul", "div", "negate", "abs",
    "max", "sum", "greater", "where", "isfinite", "logical_and", "logical_not", "clip",
    "sqrt", "pow", "cast", "detach", "reshape", "transpose", "split", "gather",
    "layer_norm", "softmax", "geluerf", "nll_loss", "matmul", "matmul_pow2scaled",
    "pow2scale_cast_to_fp8", "host_load", "host_store", "var_updates",
]


def __dir__() -> List[str]:  # only what PopXL has here
    return sorted(__all__)

def _axes(t: Tensor, axis: Union[None, int, Sequence[int]]) -> List[int]:
    if axis is None:
        return list(range(t.rank))
    axes = [axis] if isinstance(axis, int) else list(axis)
    return [a % t.rank if t.rank else 0 for a in axes]


# ------------------------------------------------------------------------------------- calls


class CallSiteInfo:
    """call.py ``CallSiteInfo``: the parent-graph tensors of one call of a graph."""

    def __init__(self, graph: _r.Graph, inputs: Sequence[Tensor], outputs: Sequence[Tensor]):
        self.called_graph = graph
        self.inputs = tuple(inputs)  # in the called graph's input order
        self.outputs = tuple(outputs)

    def graph_to_parent(self, graph_tensor: Tensor) -> Tensor:
        graph = self.called_graph
        if graph_tensor in graph.inputs:
            return self.inputs[graph.inputs.index(graph_tensor)]
        if graph_tensor in graph.outputs:
            return self.outputs[graph.outputs.index(graph_tensor)]
        raise ValueError(f"{graph_tensor} is neither an input nor an output of {graph}")


def call_with_info(graph: _r.Graph, *inputs: Any,
                   inputs_dict: Optional[Mapping[Tensor, Any]] = None) -> CallSiteInfo:
    """call.py ``call_with_info``: positional inputs feed the graph's first inputs in order,
    ``inputs_dict`` maps the remaining graph inputs to parent tensors; every input must be
    given, with the graph input's shape and dtype. Numbers become constants."""
    parent: Dict[Tensor, Tensor] = {}
    if len(inputs) > len(graph.inputs):
        raise ValueError(f"{graph} has {len(graph.inputs)} inputs, got {len(inputs)}")
    for graph_input, value in list(zip(graph.inputs, inputs)) + list((inputs_dict or {}).items()):
        if graph_input in parent:
            raise ValueError(f"{graph_input} of {graph} is given twice")
        if not isinstance(value, Tensor):
            value = _r.constant(value, graph_input.dtype)
        if value.shape != graph_input.shape or value.dtype is not graph_input.dtype:
            raise ValueError(f"{graph_input} of {graph} needs {graph_input.dtype} "
                             f"{graph_input.shape}, got {value}")
        parent[graph_input] = value
    missing = [t for t in graph.inputs if t not in parent]
    if missing:
        raise ValueError(f"call of {graph} is missing inputs {missing}")
    ordered = [parent[t] for t in graph.inputs]

    def run(state: Run, *values: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return tuple(graph._run(state, values))

    outputs = add_stateful_op("call", run, ordered, [(t.shape, t.dtype) for t in graph.outputs])
    return CallSiteInfo(graph, ordered, outputs)


def call(graph: _r.Graph, *inputs: Any, inputs_dict: Optional[Mapping[Tensor, Any]] = None
         ) -> Tuple[Tensor, ...]:
    """call.py ``call``: ``call_with_info(...).outputs``."""
    return call_with_info(graph, *inputs, inputs_dict=inputs_dict).outputs


# ------------------------------------------------------------------------------ elementwise


def abs(t: Tensor) -> Tensor:
    """abs.py."""
    return add_op("abs", torch.abs, [t])[0]


def sqrt(t: Tensor) -> Tensor:
    """sqrt.py: NaN for negative inputs."""
    return add_op("sqrt", torch.sqrt, [t])[0]


def pow(t: Tensor, e: Any) -> Tensor:
    """pow.py: ``t ** e`` elementwise, NumPy broadcasting; a number ``e`` becomes
    ``popxl.constant(e)``."""
    exponent = e if isinstance(e, Tensor) else _r.constant(e)
    return add_op("pow", torch.pow, [t, exponent])[0]


def greater(input: Tensor, other: Tensor) -> Tensor:
    """greater.py: ``input > other`` elementwise, NumPy broadcasting, a bool tensor."""
    same_dtype("greater", input, other)
    return add_op("greater", torch.gt, [input, other])[0]


def isfinite(t: Tensor) -> Tensor:
    """isfinite.py: ``~(isnan(t) | isinf(t))``."""
    return add_op("isfinite", torch.isfinite, [t])[0]


def logical_and(lhs: Tensor, rhs: Tensor) -> Tensor:
    """logical_and.py: inputs cast to bool, NumPy broadcasting."""
    return add_op("logical_and", lambda a, b: torch.logical_and(a.bool(), b.bool()),
                   [lhs, rhs])[0]


def logical_not(t: Tensor) -> Tensor:
    """logical_not.py: input cast to bool."""
    return add_op("logical_not", lambda a: torch.logical_not(a.bool()), [t])[0]


def where(condition: Tensor, lhs: Tensor, rhs: Tensor) -> Tensor:
    """where.py: ``lhs`` where ``condition`` (cast to bool) holds, else ``rhs``, broadcasting."""
    same_dtype("where", lhs, rhs)
    return add_op("where", lambda c, a, b: torch.where(c.bool(), a, b), [condition, lhs, rhs])[0]


def clip(t: Tensor, min: float = float("-inf"), max: float = float("inf")) -> Tensor:
    """clip.py: clamp to [min, max], NaN propagated. Integer tensors keep their dtype (the
    FP8 layer of popxl-addons clips int32 scaling biases this way)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            return torch.clamp(x, min, max)
        low = None if math.isinf(min) else int(math.ceil(min))
        high = None if math.isinf(max) else int(math.floor(max))
        return torch.clamp(x, low, high)
    return add_op("clip", fn, [t])[0]


def cast(t: Tensor, data_type: _r.dtype) -> Tensor:
    """cast.py: ONNX Cast (float to int truncates towards zero); FP8 targets are refused in
    favour of ``pow2scale_cast_to_fp8``, as PopXL does."""
    if data_type.fp8 is not None or t.dtype.fp8 is not None:
        raise TypeError(f"cast does not support {data_type}; use pow2scale_cast_to_fp8")
    return add_op("cast", lambda x: x.to(data_type.torch_dtype), [t])[0]


# ---------------------------------------------------------------------------------- reductions


def max(t: Tensor, axis: Union[None, int, Sequence[int]] = None, keepdims: bool = False
        ) -> Tensor:
    """max.py: maximum over ``axis`` (all axes by default). NaN propagates here; PopXL does
    not document what its reduction does with NaN (see the PopXL model's scaling bias)."""
    axes = _axes(t, axis)
    return add_op("max", lambda x: torch.amax(x, dim=axes, keepdim=keepdims), [t])[0]


def sum(t: Tensor, axis: Union[None, int, Sequence[int]] = None, keepdims: bool = False
        ) -> Tensor:
    """sum.py: sum over ``axis`` (all axes by default), in the input's dtype."""
    axes = _axes(t, axis)
    return add_op("sum", lambda x: torch.sum(x, dim=axes, keepdim=keepdims).to(x.dtype),
                   [t])[0]


# ------------------------------------------------------------------------------------ shapes


def split(t: Tensor, splits: Union[int, List[int]], axis: int = 0) -> List[Tensor]:
    """split.py: an int splits into that many equal parts (ValueError if it does not divide),
    a list gives the sizes."""
    axis = axis % t.rank
    if isinstance(splits, int):
        if t.shape[axis] % splits:
            raise ValueError(f"{splits} does not divide axis {axis} of {t}")
        sizes = [t.shape[axis] // splits] * splits
    else:
        sizes = list(splits)
    return add_op("split", lambda x: torch.split(x, sizes, dim=axis), [t])


def gather(t: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """gather.py: "Equivalent to numpy.take": the output shape is
    ``t.shape[:axis] + indices.shape + t.shape[axis + 1:]``."""
    axis = axis % t.rank

    def fn(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        flat = torch.index_select(x, axis, i.reshape(-1).long())
        return flat.reshape(x.shape[:axis] + i.shape + x.shape[axis + 1:])
    return add_op("gather", fn, [t, indices])[0]


# ------------------------------------------------------------------------- neural-net ops


def layer_norm(t: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """group_norm.py: ``layer_norm`` is ``group_norm(t, weight, bias, num_groups=1, eps)``;
    GroupNorm normalises each sample of an ``(N, C, ...)`` tensor over everything but N, with
    per-channel (dim 1) weight and bias, ``1/sqrt(var + eps)`` with the biased variance
    (willow/src/popx/op/groupnormx.cpp via popnn::gn)."""
    return add_op("layer_norm", lambda x, w, b: F.group_norm(x, 1, w, b, eps),
                   [t, weight, bias])[0]


def softmax(t: Tensor, axis: int) -> Tensor:
    """softmax.py."""
    return add_op("softmax", lambda x: torch.softmax(x, dim=axis), [t])[0]


def geluerf(t: Tensor) -> Tensor:
    """geluerf.py: the "accurate" GELU, ``x * Phi(x)`` with the error function."""
    return add_op("geluerf", F.gelu, [t])[0]


class _NllOfProbabilities(torch.autograd.Function):
    """-log(max(p, 1e-7)) and the gradient -1/max(p, 1e-10) at the label, as PopART's float32
    NllOpx / NllGradOpx compute them (willow/src/popx/op/nllx.cpp)."""

    @staticmethod
    def forward(ctx: Any, picked: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(picked)
        return -torch.log(torch.clamp(picked, min=1e-7))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (picked,) = ctx.saved_tensors
        return -grad / torch.clamp(picked, min=1e-10)


def nll_loss(probs: Tensor, labels: Tensor, ignore_index: Optional[int] = None,
             reduction: str = "mean") -> Tensor:
    """negative_log_likelihood.py ``nll_loss`` with probabilities (``log_prob=False``):
    ``-log(probs[i, labels[i]])`` per row, then the mean (or sum, or none)."""
    if ignore_index is not None:
        raise NotImplementedError("the stand-in does not implement ignore_index")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r}")

    def fn(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        picked = torch.gather(p, 1, y.long().reshape(-1, 1)).reshape(y.shape)
        losses = _NllOfProbabilities.apply(picked)
        if reduction == "none":
            return losses
        return losses.mean() if reduction == "mean" else losses.sum()
    return add_op("nll_loss", fn, [probs, labels])[0]


# ------------------------------------------------------------------------------------- FP8


def _check_log2_scale(log2_scale: Tensor) -> None:
    """cast.py / matmul.py: the scale is a scalar int32 tensor."""
    if log2_scale.rank > 0:
        raise ValueError("Log2 scale argument must be a scalar tensor")
    if log2_scale.dtype is not _r.int32:
        raise TypeError("Log2 scale tensor must be of type int32")


def _pow2(log2_scale: torch.Tensor) -> float:
    """``pow2(s)``; s must lie in [-32, 32) (docs/popxl/datatype.rst), which PopART asserts at
    run time by default (SessionOptions::throwIfLog2ScaleTensorNotInRange = true)."""
    scale = int(log2_scale)
    if not -32 <= scale < 32:
        raise RuntimeError(f"log2 scale {scale} is outside [-32, 32)")
    return math.ldexp(1.0, scale)


def pow2scale_cast_to_fp8(t: Tensor, log2_scale: Tensor, data_type: _r.dtype) -> Tensor:
    """cast.py: "a fused operation ``cast(src * pow2(log2_scale), dtype)``" from float16/32
    to ``float8_143`` or ``float8_152``, rounding to nearest even; overflow gives NaN (see the
    module docstring of :mod:`ipu_standins.popxl`)."""
    fmt = data_type.fp8
    if fmt is None:
        raise TypeError(f"Data type {data_type} not supported for pow2scale_cast_to_fp8")
    if t.dtype not in (_r.float16, _r.float32):
        raise TypeError(f"pow2scale_cast_to_fp8 casts float16 or float32, not {t.dtype}")
    _check_log2_scale(log2_scale)

    def fn(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return encode(x.float() * _pow2(s), fmt)
    return add_op("pow2scale_cast_to_fp8", fn, [t, log2_scale], [data_type])[0]


def matmul_pow2scaled(lhs: Tensor, rhs: Tensor, log2_scale: Tensor) -> Tensor:
    """matmul.py ``matmul_pow2scaled``: FP8 operands, ``matmul(lhs, rhs) * pow2(log2_scale)``,
    output float16 ("For FP8 matmuls, output type and partials type must be set to half").
    Here the exact FP8 products are summed in float32 and rounded to float16 once."""
    if lhs.dtype.fp8 is None or rhs.dtype.fp8 is None:
        raise TypeError("Scaled matmul operands must be of dtype float8_143 or float8_152")
    _check_log2_scale(log2_scale)
    lhs_fmt, rhs_fmt = lhs.dtype.fp8, rhs.dtype.fp8

    def fn(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        product = torch.matmul(decode(a, lhs_fmt), decode(b, rhs_fmt))
        # float16, unless a test asked for the unrounded sum (reference_settings)
        return (product * _pow2(s)).to(fp8_matmul_output_dtype())
    return add_op("matmul_pow2scaled", fn, [lhs, rhs, log2_scale], [_r.float16])[0]


# ------------------------------------------------------------------------------- host I/O


def host_load(h2d_stream: _r.HostToDeviceStream, name: Optional[str] = None) -> Tensor:
    """host_load.py: the next batch of the stream (one per host transfer of a run)."""
    def fn(state: Run) -> Tuple[torch.Tensor]:
        index = state.loaded.get(h2d_stream, 0)
        state.loaded[h2d_stream] = index + 1
        return (state.inputs[h2d_stream][index],)
    return add_stateful_op(name or "host_load", fn, [], [(h2d_stream.shape, h2d_stream.dtype)],
                            stream=h2d_stream)[0]


def host_store(d2h_stream: _r.DeviceToHostStream, t: Tensor) -> None:
    """host_store.py: the stream's shape and dtype must match the tensor's."""
    if d2h_stream.dtype is not t.dtype or d2h_stream.shape != t.shape:
        raise ValueError(f"{d2h_stream} does not match {t}")

    def fn(state: Run, value: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        state.stored.setdefault(d2h_stream, []).append(value.detach().clone())
        return ()
    add_stateful_op("host_store", fn, [t], [])


# ---------------------------------------------------------------------------- variable updates


class _VarUpdates:
    """``popxl.ops.var_updates`` (var_updates/*.py): in-place updates of variables, returning
    an alias of the updated tensor. Here only variables can be updated."""

    @staticmethod
    def _update(name: str, t: Tensor, inputs: List[Tensor], compute: Any) -> Tensor:
        if not isinstance(t, Variable):
            raise TypeError(f"{name}: the stand-in only updates variables, got {t}")

        def fn(state: Run, *values: torch.Tensor) -> Tuple[torch.Tensor]:
            new = compute(state.variables[t], *values).to(t.dtype.torch_dtype).detach()
            state.variables[t] = new
            return (new,)
        return add_stateful_op(name, fn, inputs, [(t.shape, t.dtype)])[0]

    @staticmethod
    def copy_var_update_(t: Tensor, X: Tensor) -> Tensor:
        """copy_var_update.py: ``t = X``."""
        if X.shape != t.shape:
            raise ValueError(f"copy_var_update_: {X} does not match {t}")
        return _VarUpdates._update("copy_var_update_", t, [X], lambda old, x: x.clone())

    @staticmethod
    def accumulate_(t: Tensor, X: Tensor, f: Union[None, float, Tensor] = None) -> Tensor:
        """accumulate.py: ``t = t + f * X``, no broadcasting, ``f`` a scalar."""
        if X.shape != t.shape:
            raise ValueError(f"accumulate_: {X} does not match {t} (no broadcasting)")
        if isinstance(f, Tensor):
            return _VarUpdates._update("accumulate_", t, [X, f],
                                       lambda old, x, factor: old + factor * x)
        factor = 1.0 if f is None else float(f)
        return _VarUpdates._update("accumulate_", t, [X], lambda old, x: old + factor * x)


var_updates = _VarUpdates()

"""PopTorch's semantics without the Poplar SDK: trace forward, differentiate the traced graph.

PopTorch compiles a training model in three steps that decide what it computes:

1. it runs the forward pass once, recording the ATen ops that reach its dispatcher (after
   PyTorch's own decompositions); ``.item()`` and other reads of a tensor on the host are
   refused, float8 tensors cannot cross, and an op without a PopART handler stops compilation;
2. PopART differentiates that forward graph: a ``torch.autograd.Function``'s ``forward`` is
   recorded like any other code and its ``backward`` is never used;
3. the optimizer runs on the device with ``trainingModel``'s batching semantics.

This module does the same on the host. :func:`trace_like_poptorch` traces a module with fake
tensors under :func:`ipu_unit_scaling.ipu_tracing`, checks every op against PopTorch's
rules (:mod:`.poptorch_ops`) and returns a :class:`PopTorchTrace`: the recorded graph, run with
the module's live parameters, so autograd of the graph plays PopART's autodiff.
:func:`check_poptorch` is the check to run before spending IPU time, and the ``emulator``
backend trains through :class:`TracedTrainingModule` with the CPU backend's batching semantics.

(:mod:`ipu_unit_scaling.emulator` is a different emulator: the FP8 codelets run tile by tile.)
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.fx import GraphModule
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..lowering import lower_graph
from ..tracing import ipu_tracing
from .poptorch_ops import CUSTOM_OP_NAMESPACES, HOST_READ_OPS, is_supported

__all__ = [
    "PopTorchError", "PopTorchReport", "PopTorchTrace", "trace_like_poptorch", "check_poptorch",
    "TracedTrainingModule",
]


class PopTorchError(RuntimeError):
    """What PopTorch would refuse while tracing the model."""


@dataclass
class PopTorchReport:
    """What tracing found: op counts and the ops PopTorch has no handler for, by module."""

    op_counts: Dict[str, int]
    unsupported: Dict[str, List[str]] = field(default_factory=dict)  # op -> module paths

    @property
    def ok(self) -> bool:
        return not self.unsupported

    def __str__(self) -> str:
        total = sum(self.op_counts.values())
        if self.ok:
            return f"PopTorch check passed: {total} ops, all supported"
        lines = [f"PopTorch check: {len(self.unsupported)} unsupported op(s) of {total} ops"]
        for op, modules in sorted(self.unsupported.items()):
            lines.append(f"  {op} in {', '.join(sorted(set(modules)))}")
        return "\n".join(lines)


def _is_float8(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and str(value.dtype).startswith("torch.float8")


class _PopTorchRules(TorchDispatchMode):
    """Checks each op as PopTorch's dispatcher would see it, naming the module it came from."""

    def __init__(self, scopes: List[str]):
        super().__init__()
        self.scopes = scopes
        self.unsupported: Dict[str, List[str]] = collections.defaultdict(list)
        # > 0 inside an op PopTorch's dispatcher takes whole (see `_DispatcherLevelOps`).
        self.inside_dispatcher_op = 0

    def _where(self) -> str:
        return self.scopes[-1] if self.scopes else "<model>"

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name in HOST_READ_OPS:
            raise PopTorchError(
                f"aten::{name} in {self._where()}: a tensor is read on the host (.item(), "
                f".tolist(), int()/float()/bool() of a tensor, or control flow on a tensor's "
                f"value). PopTorch refuses it while tracing; keep the value a tensor.")
        if any(_is_float8(a) for a in tree_flatten((args, kwargs))[0]):
            raise PopTorchError(
                f"{func} in {self._where()} takes a float8 tensor, which cannot cross PopTorch: "
                f"carry FP8 as uint8 codes through the FP8 custom ops (ipu_unit_scaling.fp8.ops)")
        if func.namespace == "prim":  # metadata queries (prim::device), not graph ops
            return func(*args, **kwargs)
        supported = self.inside_dispatcher_op > 0 or (
            is_supported(name) if func.namespace == "aten"
            else func.namespace in CUSTOM_OP_NAMESPACES)
        if not supported:
            self.unsupported[f"{func.namespace}::{name}"].append(self._where())
        out = func(*args, **kwargs)
        if any(_is_float8(o) for o in tree_flatten(out)[0]):
            raise PopTorchError(
                f"{func} in {self._where()} makes a float8 tensor, which cannot cross PopTorch")
        return out


_DISPATCHER_LEVEL_FUNCTIONS = frozenset((
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.dropout, torch.feature_dropout,
))
_DISPATCHER_LEVEL_ATEN = frozenset(("dropout", "feature_dropout"))


class _DispatcherLevelOps(TorchFunctionMode):
    """Dropout as PopTorch sees it: its dispatcher implements `aten::dropout` and
    `aten::feature_dropout` itself (`RegisterOptionalAtenOps.cpp.inc`), before PyTorch
    decomposes them into `empty_like`, `bernoulli_` and `div_`, which a dispatch mode sees
    instead. Ops inside those calls are not checked against the handler list."""

    def __init__(self, rules: _PopTorchRules):
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        whole = func in _DISPATCHER_LEVEL_FUNCTIONS or (
            packet is not None and getattr(func, "namespace", "") == "aten"
            and packet.__name__ in _DISPATCHER_LEVEL_ATEN)
        if not whole:
            return func(*args, **kwargs)
        self.rules.inside_dispatcher_op += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.rules.inside_dispatcher_op -= 1


@contextlib.contextmanager
def _module_scopes(module: nn.Module, scopes: List[str]) -> Iterator[None]:
    """Keep ``scopes[-1]`` the qualified name of the module whose forward is running."""
    handles = []
    for name, child in module.named_modules():
        label = name or type(module).__name__

        def enter(_: nn.Module, __: Any, label: str = label) -> None:
            scopes.append(label)

        def leave(_: nn.Module, __: Any, ___: Any) -> None:
            scopes.pop()

        handles.append(child.register_forward_pre_hook(enter))
        handles.append(child.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class PopTorchTrace:
    """A module's forward as PopTorch records it, callable with the module's live parameters.

    Calling it runs the recorded ATen graph (and FP8 custom ops) on real tensors; autograd of
    that graph is what PopART's autodiff computes. It is valid for inputs of the traced shapes
    and dtypes and the traced train/eval mode.
    """

    def __init__(self, module: nn.Module, graph: GraphModule, report: PopTorchReport,
                 parameter_names: List[str], buffer_names: List[str]):
        self.module = module
        self.graph = graph
        self.report = report
        self.parameter_names = parameter_names
        self.buffer_names = buffer_names

    def __call__(self, *inputs: Any) -> Any:
        parameters = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        return self.graph([parameters[n] for n in self.parameter_names],
                          [buffers[n] for n in self.buffer_names], *inputs)

    def ops(self) -> List[str]:
        """The ops of the graph in execution order, e.g. ``aten::mm``."""
        names = []
        for node in self.graph.graph.nodes:
            if node.op == "call_function" and hasattr(node.target, "overloadpacket"):
                names.append(f"{node.target.namespace}::{node.target.overloadpacket.__name__}")
        return names


def _make_fx() -> Callable[..., Any]:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx


def _functional_call(module: nn.Module, state: Dict[str, torch.Tensor],
                     inputs: Tuple[Any, ...]) -> Any:
    from torch.func import functional_call

    return functional_call(module, state, inputs)


def trace_like_poptorch(module: nn.Module, *inputs: Any,
                        stochastic_rounding: bool = False) -> PopTorchTrace:
    """Trace ``module(*inputs)`` the way PopTorch does (see the module docstring).

    Raises :class:`PopTorchError` for what PopTorch refuses while tracing (host reads of a
    tensor, float8 tensors), naming the op and the module; unsupported ops are collected in
    ``trace.report``. The module's train/eval mode is traced as it is.

    The trace computes what an IPU computes where PopART departs from eager torch (GELU; with
    ``stochastic_rounding``, as ``Precision.enableStochasticRounding``, the float-half casts):
    see :mod:`ipu_unit_scaling.lowering`.
    """
    parameter_names = [name for name, _ in module.named_parameters()]
    buffer_names = [name for name, _ in module.named_buffers()]
    scopes: List[str] = []
    rules = _PopTorchRules(scopes)

    def forward(parameters: List[torch.Tensor], buffers: List[torch.Tensor], *args: Any) -> Any:
        state = dict(zip(parameter_names, parameters))
        state.update(zip(buffer_names, buffers))
        with ipu_tracing(), _module_scopes(module, scopes), rules, _DispatcherLevelOps(rules):
            return _functional_call(module, state, args)

    parameters = [p for _, p in module.named_parameters()]
    buffers = [b for _, b in module.named_buffers()]
    try:
        graph = _make_fx()(forward, tracing_mode="fake")(parameters, buffers, *inputs)
    except PopTorchError:
        raise
    except Exception as error:
        cause = error
        while cause is not None and not isinstance(cause, PopTorchError):
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        if isinstance(cause, PopTorchError):
            raise PopTorchError(str(cause)) from None
        raise
    counts: Dict[str, int] = collections.Counter()
    for node in graph.graph.nodes:
        if node.op == "call_function" and hasattr(node.target, "overloadpacket"):
            counts[f"{node.target.namespace}::{node.target.overloadpacket.__name__}"] += 1
    report = PopTorchReport(dict(counts), {k: list(v) for k, v in rules.unsupported.items()})
    graph = lower_graph(graph, stochastic_rounding)
    return PopTorchTrace(module, graph, report, parameter_names, buffer_names)


def check_poptorch(model: nn.Module, *inputs: Any, strict: bool = True) -> PopTorchReport:
    """Check that PopTorch can train ``model`` on ``inputs``, before spending IPU time.

    Traces like PopTorch (fake tensors: nothing is computed) and returns the report. Raises
    :class:`PopTorchError` for host reads and float8 tensors, and with ``strict`` also for ops
    PopTorch has no handler for, listing each with the modules it came from.
    """
    report = trace_like_poptorch(model, *inputs).report
    if strict and not report.ok:
        raise PopTorchError(str(report))
    return report


class TracedTrainingModule(nn.Module):
    """Runs the wrapped module through :func:`trace_like_poptorch` (one trace per input
    signature and train/eval mode), so its gradients are those PopART would compute;
    ``stochastic_rounding`` as in :func:`trace_like_poptorch`."""

    def __init__(self, module: nn.Module, stochastic_rounding: bool = False):
        super().__init__()
        self.module = module
        self.stochastic_rounding = stochastic_rounding
        self._traces: Dict[Tuple[Any, ...], PopTorchTrace] = {}

    def _signature(self, inputs: Sequence[Any]) -> Tuple[Any, ...]:
        shapes = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x
                       for x in inputs)
        return shapes + (self.module.training,)

    def forward(self, *inputs: Any) -> Any:
        key = self._signature(inputs)
        trace = self._traces.get(key)
        if trace is None:
            trace = trace_like_poptorch(self.module, *inputs,
                                        stochastic_rounding=self.stochastic_rounding)
            if not trace.report.ok:
                raise PopTorchError(str(trace.report))
            self._traces[key] = trace
        return trace(*inputs)

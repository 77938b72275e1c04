"""PopTorch's trace without the Poplar SDK: trace forward, differentiate the traced graph.

PopTorch compiles a model in steps that decide what it computes:

1. it runs the forward pass once, recording the ATen ops that reach its dispatcher (after
   PyTorch's own decompositions); ``.item()`` and other reads of a tensor on the host are
   refused, so are moves to the CPU, and float8 tensors cannot cross; a CPU tensor made inside
   ``forward`` (:mod:`._devices`) cannot meet an IPU tensor in an op;
2. ops whose inputs are all compile-time constants are evaluated on the host; every other op
   needs a handler, and some handlers refuse some arguments (:mod:`._handlers`);
3. PopART differentiates that forward graph: a ``torch.autograd.Function``'s ``forward`` is
   recorded like any other code and its ``backward`` is never used; a PopART custom op
   (``poptorch.custom_op``) is one op, differentiated by its grad op.

This module does these steps on the host. :func:`trace_like_poptorch` traces a module with fake
tensors, checks every op against PopTorch's rules and returns a :class:`PopTorchTrace`: the
recorded graph, run with the module's live parameters, so autograd of the graph plays PopART's
autodiff. The stand-in compiles every model with this trace (:mod:`._compile`), and adds its
checks after tracing; its executor runs the optimizer with ``trainingModel``'s semantics.
Refusals are the stand-in's ``poptorch.Error``.
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.fx import GraphModule
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from ..poptorch_custom_ops import inside_custom_op, is_library_torch_op
from ._captured import call_as_captured, compiling, dynamo_compiles_inside_trace
from ._devices import (
    IPU_FACTORIES,
    LEGACY_CONSTRUCTOR_OPS,
    UPLOADS,
    cpu_tensor_refusal,
    names_ipu,
    on_host,
)
from ._handlers import ARGUMENT_RULES, HOST_READ_OPS, base_name, is_supported
from ._host_forms import math_attention, one_hot_without_checks, static_bincount
from ._losses import ctc_loss
from ._lowering import lower_graph
from .poptorch_core import Error as PopTorchError

__all__ = ["PopTorchReport", "PopTorchTrace", "trace_like_poptorch", "SCOPE_META"]

# The key of a node's ``meta`` that holds the path of the module whose forward made it.
SCOPE_META = "poptorch_scope"


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


def _tensors(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _named_arguments(func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The op's arguments by their schema names, defaults filled in."""
    named: Dict[str, Any] = {}
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            named[argument.name] = args[index]
        elif argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            named[argument.name] = argument.default_value
    return named


def _proxy_graph() -> Optional[torch.fx.Graph]:
    """The graph ``make_fx`` is recording into, if any (torch 2.0's mode stack, or the proxy
    mode's own slot in newer versions)."""
    for mode in _get_current_dispatch_mode_stack():
        if hasattr(mode, "tracer"):
            return mode.tracer.graph
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "PROXY", None)
    proxy: Any = torch._C._get_dispatch_mode(key) if key is not None else None
    return proxy.tracer.graph if proxy is not None and hasattr(proxy, "tracer") else None


def _is_composite(func: Any) -> bool:
    """Whether ``func`` has a CompositeImplicitAutograd kernel (made of other ops); torch 2.0.1's
    OpOverload has no ``has_kernel_for_dispatch_key``, its dispatcher the same query."""
    key = torch._C.DispatchKey.CompositeImplicitAutograd
    query = getattr(func, "has_kernel_for_dispatch_key", None)
    if query is not None:
        return bool(query(key))
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), key))


class _PopTorchRules(TorchDispatchMode):
    """Checks each op as PopTorch's dispatcher would see it, naming the module it came from.

    It also follows which tensors are compile-time constants: the trace's inputs, parameters
    and buffers are not, nor is anything computed from them or drawn at random. An ATen op on
    constants only is evaluated on the host by PopTorch before any handler runs, so it is
    neither checked against the handler list nor against the handlers' argument rules.
    """

    ignore_compile_internals = classmethod(lambda cls: True)  # see ._captured

    def __init__(self, scopes: List[str]):
        super().__init__()
        self.scopes = scopes
        self.unsupported: Dict[str, List[str]] = collections.defaultdict(list)
        # > 0 inside an op PopTorch's dispatcher takes whole (see `_PopTorchCalls`).
        self.inside_dispatcher_op = 0
        # id -> tensor (kept alive so that ids stay unique) of the tensors that are not
        # compile-time constants.
        self._variable: Dict[int, torch.Tensor] = {}
        # id -> device object of the tensors of the trace: on an IPU these are the IPU.
        self.devices: Dict[int, Any] = {}
        # id -> tensor of the views that are slices with a step other than 1 (or views of
        # one), which PopTorch cannot modify in place.
        self._strided: Dict[int, torch.Tensor] = {}
        # id -> tensor of the CPU tensors made inside forward (see :mod:`._devices`).
        self._cpu: Dict[int, torch.Tensor] = {}
        # > 0 while a torch function called from Python runs (see `_PopTorchCalls`): an op
        # dispatched outside any comes from C++, such as a legacy constructor.
        self.python_calls = 0

    def where(self) -> str:
        return self.scopes[-1] if self.scopes else "<model>"

    def refusal(self, op: str, reason: str) -> PopTorchError:
        return PopTorchError(f"{op} in {self.where()}: {reason}")

    def mark_variable(self, value: Any) -> None:
        for tensor in _tensors(value):
            self._variable[id(tensor)] = tensor
            self.devices[id(tensor.device)] = tensor.device

    def is_constant(self, value: Any) -> bool:
        return not any(id(t) in self._variable for t in _tensors(value))

    def mark_cpu(self, value: Any, on_cpu: bool = True) -> None:
        for tensor in _tensors(value):
            if on_cpu:
                self._cpu[id(tensor)] = tensor
            else:
                self._cpu.pop(id(tensor), None)

    def _check_devices(self, func: Any, name: str, args: Sequence[Any],
                       kwargs: Dict[str, Any]) -> bool:
        """Whether the op's tensors are all CPU tensors (then so are its results); refuses a
        CPU tensor among IPU tensors as PopTorch's dispatcher does."""
        tensors = _tensors((args, kwargs))
        cpu = [t for t in tensors if id(t) in self._cpu]
        if not cpu:
            return False
        if len(cpu) == len(tensors):
            return True
        if func.namespace == "aten" and name not in UPLOADS and (
                self.inside_dispatcher_op == 0) and not inside_custom_op():
            raise self.refusal(f"aten::{name}", cpu_tensor_refusal(cpu[0]))
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name in HOST_READ_OPS and not self.is_constant(
                (args, kwargs)):
            raise self.refusal(
                f"aten::{name}",
                "a tensor is read on the host (.item(), .tolist(), int()/float()/bool() of a "
                "tensor, or control flow on a tensor's value). PopTorch refuses it while "
                "tracing; keep the value a tensor.")
        if any(_is_float8(a) for a in tree_flatten((args, kwargs))[0]):
            raise self.refusal(
                str(func), "takes a float8 tensor, which cannot cross PopTorch: carry FP8 as "
                "uint8 codes through custom ops")
        if func.namespace == "prim":  # metadata queries (prim::device), not graph ops
            return func(*args, **kwargs)
        if torch.is_inference_mode_enabled() and hasattr(func, "decompose") and _is_composite(
                func):
            # Under torch.inference_mode a composite op (broadcast_tensors in mse_loss)
            # reaches the mode whole; PopTorch's dispatcher sees the ops it is made of.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        variable = not self.is_constant((args, kwargs)) or (
            torch.Tag.nondeterministic_seeded in func.tags)
        if self.inside_dispatcher_op == 0 and not inside_custom_op():
            if func.namespace != "aten":
                if func.namespace != "poptorch" and not is_library_torch_op(
                        f"{func.namespace}::{name}"):
                    self.unsupported[f"{func.namespace}::{name}"].append(self.where())
            elif variable:
                self._check_arguments(func, name, args, kwargs)
                if not is_supported(name):
                    self.unsupported[f"aten::{name}"].append(self.where())
        self._check_strided_write(func, name, args, kwargs)
        on_cpu = self._check_devices(func, name, args, kwargs) or (
            self.python_calls == 0 and func.namespace == "aten"
            and name in LEGACY_CONSTRUCTOR_OPS and not variable)
        graph = _proxy_graph()
        last = graph._root.prev if graph is not None else None  # type: ignore[attr-defined]
        out = func(*args, **kwargs)
        if graph is not None and last is not None:
            # The module path of the nodes this op added: PopTorch's name scopes.
            node = last.next
            while node is not graph._root:  # type: ignore[attr-defined]
                node.meta.setdefault(SCOPE_META, self.where())
                node = node.next
        if func.namespace == "aten" and variable:
            self._follow_strided_views(func, name, args, kwargs, out)
        if any(_is_float8(o) for o in tree_flatten(out)[0]):
            raise self.refusal(str(func), "makes a float8 tensor, which cannot cross PopTorch")
        if any(not isinstance(size, int) for t in _tensors(out) for size in t.shape):
            # A size that depends on the values (boolean-mask indexing, nonzero): PopTorch's
            # shape inference raises this (torch 2.0's fake tensors do; newer ones trace
            # the size as a symbol, which a static IPU graph cannot have).
            raise DynamicOutputShapeException(func)
        for tensor in _tensors(out):
            device = tensor.device  # one object per fake tensor: `.to(t.device)` is found
            self.devices[id(device)] = device
        if on_cpu:
            self.mark_cpu(out)
        if variable:
            self.mark_variable(out)
            for value, argument in zip(args, func._schema.arguments):
                if argument.alias_info is not None and argument.alias_info.is_write:
                    self.mark_variable(value)  # written in place with a variable value
        return out

    def _follow_strided_views(self, func: Any, name: str, args: Sequence[Any],
                              kwargs: Dict[str, Any], out: Any) -> None:
        """Remember the views that are slices with a step other than 1, or views of one."""
        if not isinstance(out, torch.Tensor) or not func._schema.returns or (
                func._schema.returns[0].alias_info is None) or (
                func._schema.returns[0].alias_info.is_write):
            return
        strided = any(id(a) in self._strided for a in args if isinstance(a, torch.Tensor))
        if name == "slice":
            strided = strided or _named_arguments(func, args, kwargs).get("step", 1) != 1
        if strided:
            self._strided[id(out)] = out

    def _check_strided_write(self, func: Any, name: str, args: Sequence[Any],
                             kwargs: Dict[str, Any]) -> None:
        # PopTorch writes a modified slice back with a dynamic update, which has no step
        # (PopartCanonicalization.cpp).
        for value, argument in zip(args, func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write and (
                    id(value) in self._strided):
                raise PopTorchError("In-place modification of slices with step size other "
                                    f"than 1 is not supported. (aten::{name} in "
                                    f"{self.where()})")

    def _check_arguments(self, func: Any, name: str, args: Sequence[Any],
                         kwargs: Dict[str, Any]) -> None:
        rules = ARGUMENT_RULES.get(name) or ARGUMENT_RULES.get(base_name(name), ())
        if not rules:
            return
        named = _named_arguments(func, args, kwargs)
        for rule in rules:
            if rule.refuses(named, self.is_constant):
                raise self.refusal(f"aten::{name}", f"{rule.reason} "
                                   f"(poptorch/source/popart_canonicalization/{rule.source})")


# Functions PopTorch's dispatcher implements itself (`RegisterOptionalAtenOps.cpp.inc`), which
# a dispatch mode would only see decomposed: dropout into `empty_like`, `bernoulli_` and
# `div_`, one_hot, adaptive pooling, bilinear, the hinge embedding and CTC losses and the
# recurrent layers (which PopTorch lowers to PopART's LSTM, GRU and RNN) into other ops. Ops
# inside them are not checked.
_DISPATCHER_LEVEL_FUNCTIONS = frozenset((
    torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
    torch.nn.functional.dropout3d, torch.dropout, torch.feature_dropout,
    torch.nn.functional.one_hot, torch.nn.functional.adaptive_avg_pool1d,
    torch.nn.functional.adaptive_avg_pool2d, torch.nn.functional.adaptive_avg_pool3d,
    torch.nn.functional.hinge_embedding_loss, torch.hinge_embedding_loss,
    torch.nn.functional.ctc_loss, torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu,
    torch.nn.functional.bilinear, torch.bilinear, torch.bincount,
))
_DISPATCHER_LEVEL_ATEN = frozenset(("dropout", "feature_dropout"))
_ADAPTIVE_POOLS = {torch.nn.functional.adaptive_avg_pool1d: 1,
                   torch.nn.functional.adaptive_avg_pool2d: 2,
                   torch.nn.functional.adaptive_avg_pool3d: 3}
_HOST_READ_METHODS = {torch.Tensor.numpy: "Tensor.numpy", torch.Tensor.tolist: "Tensor.tolist"}
_DEVICE_PROPERTY = torch.Tensor.device


def _is_device_getter(func: Any) -> bool:
    """``tensor.device`` (each access to the getter makes a new method-wrapper object)."""
    return getattr(func, "__self__", None) is _DEVICE_PROPERTY and (
        getattr(func, "__name__", "") == "__get__")


class _PopTorchCalls(TorchFunctionMode):
    """What PopTorch decides from the Python call rather than the ATen op.

    - Dropout, one_hot and adaptive average pooling as PopTorch's dispatcher takes them: whole
      (see `_DISPATCHER_LEVEL_FUNCTIONS`), with their handlers' argument checks.
    - Moves to the CPU inside ``forward`` (``.cpu()``, ``.to("cpu")``): PopTorch traces on the
      IPU device, and its ``copy_`` refuses an IPU to CPU copy except for the outputs
      (``RegisterAtenOverloads.cpp``). ``.to(t.device)`` stays on the IPU there, so devices
      read from tensors are remembered and let through.
    - Reads of a tensor's data on the host (``.numpy()``, ``.tolist()``).
    - Which tensors made inside ``forward`` are CPU tensors (:mod:`._devices`); a device
      ``"ipu"`` is the IPU, traced on the host's device.
    """

    def __init__(self, rules: _PopTorchRules):
        super().__init__()
        self.rules = rules
        self._tensor_devices: Dict[int, Any] = {}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.device or compiling():  # see ._captured
            return call_as_captured(func, args, kwargs)
        if _is_device_getter(func):
            device = func(*args, **kwargs)
            self._tensor_devices[id(device)] = device
            return device
        to_ipu = any(names_ipu(a) for a in (*args, *kwargs.values()))
        args = tuple(on_host(a) for a in args)
        kwargs = {k: on_host(v) for k, v in kwargs.items()}
        self._refuse_host_access(func, args, kwargs, to_ipu)
        if func is torch.nn.functional.scaled_dot_product_attention:
            with self:  # its math form's ops meet these rules (._host_forms)
                return math_attention(*args, **kwargs)
        packet = getattr(func, "overloadpacket", None)
        whole = func in _DISPATCHER_LEVEL_FUNCTIONS or (
            packet is not None and getattr(func, "namespace", "") == "aten"
            and packet.__name__ in _DISPATCHER_LEVEL_ATEN)
        if func is torch.bincount:
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            if minlength <= 0 or self.rules.is_constant((args, kwargs)):
                whole = False  # refused by the argument rule, or evaluated on the host
            else:
                func = static_bincount  # a size torch would read from the values
        if not whole:
            self.rules.python_calls += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self.rules.python_calls -= 1
            self._follow_devices(func, args, kwargs, to_ipu, out)
            return out
        if func is torch.nn.functional.one_hot:
            classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
            if classes == -1 and not self.rules.is_constant(args[0]):
                raise self.rules.refusal(
                    "aten::one_hot", "OneHot num classes must be specified and must be "
                    "constant. (poptorch/source/popart_canonicalization/EmbeddingOps.cpp)")
            if classes != -1:
                # The same values without torch's range checks, which read the indices on
                # the host; PopTorch takes one_hot whole.
                func = one_hot_without_checks
        if func is torch.nn.functional.ctc_loss:
            func = ctc_loss  # torch's kernel has a value-dependent shape: see ._losses
        self.rules.inside_dispatcher_op += 1
        self.rules.python_calls += 1
        try:
            out = func(*args, **kwargs)
        finally:
            self.rules.inside_dispatcher_op -= 1
            self.rules.python_calls -= 1
        dims = _ADAPTIVE_POOLS.get(func)
        if dims is not None and not self.rules.is_constant(args[0]):
            sizes_in, sizes_out = args[0].shape[-dims:], out.shape[-dims:]
            if any(o and i % o for i, o in zip(sizes_in, sizes_out)):
                raise self.rules.refusal(
                    f"aten::adaptive_avg_pool{dims}d",
                    f"input sizes {tuple(sizes_in)} are not multiples of the output sizes "
                    f"{tuple(sizes_out)}, which the handler refuses "
                    "(poptorch/source/popart_canonicalization/PoolingOps.cpp)")
        return out

    def _follow_devices(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any],
                        to_ipu: bool, out: Any) -> None:
        if func is torch.Tensor.to:
            if to_ipu or not self._moves_to_cpu(args, kwargs) and (
                    self._names_device(args, kwargs)):
                self.rules.mark_cpu(out, on_cpu=False)  # moved to the IPU: a constant
            return
        if func in IPU_FACTORIES or "device" in kwargs or getattr(
                torch, getattr(func, "__name__", ""), None) is not func:
            return
        if not _tensors((args, kwargs)):
            self.rules.mark_cpu(out)  # a factory PopTorch leaves on the CPU

    @staticmethod
    def _names_device(args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
        """Whether ``Tensor.to``'s arguments name a device or a tensor (not only a dtype)."""
        return any(isinstance(a, (str, torch.device, torch.Tensor)) for a in (
            *args[1:], *kwargs.values()))

    def _refuse_host_access(self, func: Any, args: Sequence[Any],
                            kwargs: Dict[str, Any], to_ipu: bool = False) -> None:
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and not to_ipu and (
                self._moves_to_cpu(args, kwargs))):
            call = "Tensor.cpu" if func is torch.Tensor.cpu else "Tensor.to"
            raise self.rules.refusal(
                call, "a move to the CPU inside forward. PopTorch refuses it while tracing "
                "(illegal move to CPU, RegisterAtenOverloads.cpp): return the tensor as an "
                "output instead")
        if func in _HOST_READ_METHODS:
            raise self.rules.refusal(
                _HOST_READ_METHODS[func], "a tensor is read on the host. PopTorch refuses it "
                "while tracing; keep the value a tensor.")

    def _moves_to_cpu(self, args: Sequence[Any], kwargs: Dict[str, Any]) -> bool:
        if any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values())):
            return False  # .to(other): other's device, the IPU for any tensor in the trace
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        if self._is_tensor_device(device, args[0]):
            return False  # a device read from a tensor of the trace: the IPU on an IPU
        parsed = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        return parsed is not None and parsed.type == "cpu"

    def _is_tensor_device(self, device: Any, tensor: torch.Tensor) -> bool:
        # Fake tensors keep one device object each, which the rules record; real tensors
        # make one per access, which the getter above records.
        return (id(device) in self._tensor_devices or id(device) in self.rules.devices
                or device is tensor.device)


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

    Calling it runs the recorded ATen graph (and the package's custom ops, each one node whose
    gradient comes from the op's Autograd kernel, as PopART's comes from the grad op) on real
    tensors; autograd of that graph is what PopART's autodiff computes. It is valid for inputs
    of the traced shapes and dtypes and the traced train/eval mode.
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


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor (an alias) if it is of a subclass, such as the parameters
    PopTorch wraps once it has trained a model: the trace only reads its metadata, and torch
    2.0.1's fake tensors do not convert subclasses."""
    if type(tensor) in (torch.Tensor, nn.Parameter):
        return tensor
    with torch._C.DisableTorchFunction():
        return torch.Tensor._make_subclass(torch.Tensor, tensor.detach(), tensor.requires_grad)


def trace_like_poptorch(module: nn.Module, *inputs: Any, stochastic_rounding: bool = False,
                        allow_constants: bool = False,
                        context: Optional[Callable[[], ContextManager[Any]]] = None
                        ) -> PopTorchTrace:
    """Trace ``module(*inputs)`` the way PopTorch does (see the module docstring).

    Raises :class:`PopTorchError` for what PopTorch refuses while tracing (host reads of a
    tensor, moves to the CPU, float8 tensors, arguments a handler refuses), naming the op and
    the module; unsupported ops are collected in ``trace.report``. The module's train/eval
    mode is traced as it is.

    The trace computes what an IPU computes where PopART departs from eager torch (GELU; with
    ``stochastic_rounding``, as ``Precision.enableStochasticRounding``, the float-half casts):
    see :mod:`._lowering`.

    With ``allow_constants``, tensors the model holds outside its parameters and buffers (a
    closure's target, a global table) become constants of the graph, as PopTorch uploads them,
    instead of being refused by the fake tensors. ``context`` makes a context manager entered
    around the module's forward, innermost (a library's switch into its traced forms).
    """
    parameter_names = [name for name, _ in module.named_parameters()]
    buffer_names = [name for name, _ in module.named_buffers()]
    scopes: List[str] = []
    rules = _PopTorchRules(scopes)

    def forward(parameters: List[torch.Tensor], buffers: List[torch.Tensor], *args: Any) -> Any:
        state = dict(zip(parameter_names, parameters))
        state.update(zip(buffer_names, buffers))
        rules.mark_variable((parameters, buffers, args))  # graph inputs, never constants
        with contextlib.ExitStack() as stack:
            stack.enter_context(_module_scopes(module, scopes))
            stack.enter_context(rules)
            stack.enter_context(_PopTorchCalls(rules))
            stack.enter_context(dynamo_compiles_inside_trace())
            if context is not None:  # the caller's, innermost: as if inside forward
                stack.enter_context(context())
            return _functional_call(module, state, args)

    parameters = [_plain(p) for _, p in module.named_parameters()]
    buffers = [_plain(b) for _, b in module.named_buffers()]
    try:
        graph = _make_fx()(forward, tracing_mode="fake", _allow_non_fake_inputs=allow_constants)(
            parameters, buffers, *inputs)
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

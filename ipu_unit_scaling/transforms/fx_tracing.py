"""torch.fx tracing that resolves Python control flow from example inputs.

Plain `torch.fx.symbolic_trace` stops at the first `if` on a traced value (a shape check, an
`is_nested` test, a mask that may be absent). `ConcreteTracer` runs every node on real example
values as it records it, so such a condition is answered by its value on the example inputs and
the traced graph is specialised to that branch. Non-tensor arguments are baked into the graph the
same way (fx adds a guard for None, bool and number arguments).

A function that a library has turned into a module instance (Hugging Face's `kernels` does so,
see `function_behind`) is traced as the function it stands for.
"""
from __future__ import annotations

import contextlib
import dis
import functools
import inspect
import re
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn

__all__ = [
    "ConcreteTracer", "ArgumentFrame", "SpecialisedCall", "capture_inputs", "trace_module",
    "Inputs", "function_behind", "TRANSFORMERS_TESTED", "TRANSFORMERS_5_OLDEST",
    "transformers_unsupported", "FailedAssertion",
]

# (args, kwargs) of one call.
Inputs = Tuple[Tuple[Any, ...], Dict[str, Any]]

_UNKNOWN = object()


class ConcreteTracer(fx.Tracer):
    """An fx tracer with a leaf policy and concrete values for control flow.

    `is_leaf(module, qualified_name)` decides which modules become single `call_module` nodes;
    every other module, including `torch.nn` containers and layers such as
    `nn.TransformerEncoderLayer`, is traced through.
    """

    def __init__(
        self, is_leaf: Callable[[nn.Module, str], bool],
        autowrap_functions: Tuple[Callable[..., Any], ...] = (),
    ) -> None:
        # `autowrap_functions` are recorded as single calls wherever a traced module's code
        # calls them by a global name, instead of being traced through. One given as a
        # function-turned-module is recorded as the function it stands for.
        self._single_calls = {_plain(function) for function in autowrap_functions}
        super().__init__(autowrap_functions=tuple(self._single_calls))
        self._is_leaf = is_leaf
        self._inputs: Dict[str, Any] = {}
        self._values: Dict[fx.Node, Any] = {}
        self.specialised: List[str] = []
        self.tensor_nodes: Optional[Set[str]] = None
        self._real_attributes = False
        # A buffer read is a graph node, so that it can be sliced by traced lengths (transformers
        # 4's `self.position_ids[:, :seq_length]`, GPT-2's causal `self.bias[..., :key_length]`).
        self.proxy_buffer_attributes = True

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        if self._real_attributes:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._is_leaf(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
    ) -> Any:
        if self._real_attributes:  # running a leaf on real values: its submodules record nothing
            return forward(*args, **kwargs)
        function = function_behind(m)
        if function is None:
            if _made_in_forward(self, m):
                return forward(*args, **kwargs)
            return super().call_module(m, forward, args, kwargs)
        # Not a layer of the model but a function called by its global name: record it as the
        # function (one call where it is to be kept whole), else trace through it.
        traced = any(isinstance(leaf, fx.Proxy) for leaf in pytree.tree_flatten((args, kwargs))[0])
        if traced and function in self._single_calls:
            return self.create_proxy("call_function", function, args, kwargs)
        return function(*args, **kwargs)

    def trace(self, root: Any, concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        with _factories_accept_proxies(), _type_info_of_traced_dtypes(self):
            return super().trace(root, concrete_args)

    def trace_with_inputs(
        self, root: nn.Module, inputs: Optional[Dict[str, Any]], concrete_args: Any
    ) -> fx.Graph:
        self._inputs = dict(inputs or {})
        self._values = {}
        try:
            graph = self.trace(root, concrete_args=concrete_args or None)
            if self._inputs:
                self.tensor_nodes = {
                    node.name for node, value in self._values.items() if _carries_data(value)
                }
            return graph
        finally:
            self._values = {}

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):  # type: ignore[no-untyped-def]
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self._inputs:
            value = self._values[node] = self._evaluate(node)
            if isinstance(value, Tensor):  # for rewrites that need a size or a constant
                node.meta["example_shape"] = tuple(value.shape)
                if value.dim() == 0 and value.is_floating_point():
                    node.meta["example_scalar"] = float(value)
        return node

    def _evaluate(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            name = str(node.target).lstrip("*")
            if name in self._inputs:
                return self._inputs[name]
            return _UNKNOWN
        if node.op == "output":
            return _UNKNOWN
        try:
            args = fx.node.map_arg(node.args, self._value_of)
            kwargs = fx.node.map_arg(node.kwargs, self._value_of)
        except LookupError:
            return _UNKNOWN
        # The real modules run while fx's patches are active: call them unpatched, and keep
        # their parameter reads from turning into graph nodes.
        outer, self._real_attributes = self._real_attributes, True
        try:
            with torch.no_grad():
                if node.op == "get_attr":
                    return _get_attr(self.root, str(node.target))
                if node.op == "call_function":
                    return node.target(*args, **kwargs)  # type: ignore[operator]
                if node.op == "call_method":
                    return getattr(args[0], str(node.target))(*args[1:], **kwargs)
                if node.op == "call_module":
                    module = self.root.get_submodule(str(node.target))
                    # The leaf's arguments in this trace, which may differ from an eager
                    # call's (Hugging Face builds masks only while tracing).
                    node.meta["example_inputs"] = (tuple(args), dict(kwargs))
                    return _unpatched_module_call(module, *args, **kwargs)
        except Exception:  # a value we cannot compute only matters if control flow needs it
            return _UNKNOWN
        finally:
            self._real_attributes = outer
        return _UNKNOWN

    def _value_of(self, node: fx.Node) -> Any:
        value = self._values.get(node, _UNKNOWN)
        if value is _UNKNOWN:
            raise LookupError(node.name)
        return value

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ConcreteProxy(node, self)

    def concrete_value(self, node: fx.Node) -> Any:
        """The node's value on the example inputs, or raise TraceError."""
        value = self._values.get(node, _UNKNOWN)
        if value is _UNKNOWN:
            raise fx.proxy.TraceError(
                f"control flow depends on {node.name!r}, whose value is unknown: pass "
                "example inputs so that it can be resolved"
            )
        self.specialised.append(node.name)
        return value

    def to_bool(self, obj: fx.Proxy) -> bool:
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is not None and _asserts(caller):
            # An assertion checks rather than branches: it stays in the graph as a check run
            # on every call (nanoGPT's `assert t <= block_size`), instead of fixing the graph
            # to the example's value. One already false on the example fails as in eager.
            value = self._values.get(obj.node, _UNKNOWN)
            if value is not _UNKNOWN and not bool(value):
                raise FailedAssertion(f"{caller.f_code.co_filename}:{caller.f_lineno}: an "
                                      "assertion of the traced module fails on these inputs")
            self.create_proxy("call_function", torch._assert,
                              (obj, "an assertion of the traced module failed"), {})
            return True
        return bool(self.concrete_value(obj.node))

    def iter(self, obj: fx.Proxy):  # type: ignore[no-untyped-def]
        value = self._values.get(obj.node, _UNKNOWN)
        if isinstance(value, (tuple, list, torch.Size)):
            return iter([obj[i] for i in range(len(value))])  # type: ignore[index]
        return super().iter(obj)


class FailedAssertion(AssertionError):
    """An `assert` of the traced module fails on the inputs it is traced with, as it would
    in eager: a conversion stops there rather than falling back."""


# Instructions between a condition's test and its jump that do nothing to the value.
_PASSIVE = ("CACHE", "EXTENDED_ARG", "NOT_TAKEN", "TO_BOOL", "COPY")


def _asserts(frame: Any) -> bool:
    """Whether `frame` is testing the condition of an `assert` statement: a jump taken when
    the condition holds, over the load of AssertionError."""
    instructions = [i for i in dis.get_instructions(frame.f_code)]
    at = next((n for n, i in enumerate(instructions) if i.offset == frame.f_lasti), None)
    if at is None:
        return False
    following = [i for i in instructions[at:at + 8] if i.opname not in _PASSIVE]
    if len(following) < 2 or not ("JUMP" in following[0].opname
                                  and following[0].opname.endswith("IF_TRUE")):
        return False
    load = following[1]
    return load.opname == "LOAD_ASSERTION_ERROR" or (
        load.opname in ("LOAD_GLOBAL", "LOAD_COMMON_CONSTANT")
        and load.argval == "AssertionError")


def function_behind(module: Any) -> Optional[Callable[..., Any]]:
    """The plain function that a function-turned-module stands for; None for anything else.

    Hugging Face's `kernels` package (a dependency of transformers 5) turns a function decorated
    with `use_kernel_forward_from_hub`, such as Llama's `apply_rotary_pos_emb`, into an instance
    of a one-off `nn.Module` class, so that a kernel from the Hub can be swapped in for it; the
    module's global name is then that instance. Called as a function from a layer's code, it is
    no submodule of the model and has no `__name__`, so torch.fx can neither record it as a
    layer ("module is not installed as a submodule") nor as a function ("'Func' object has no
    attribute '__name__'"). The function it wraps is what it runs unless `kernels.kernelize`
    swapped in a kernel, which computes the same function.
    """
    if not isinstance(module, nn.Module) or not hasattr(type(module), "kernel_layer_name"):
        return None
    if next(module.children(), None) is not None or next(module.parameters(), None) is not None:
        return None  # a layer whose forward a kernel may replace, not a function
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    closure = getattr(forward, "__closure__", None) or ()
    if code is None:
        return None
    cells = dict(zip(code.co_freevars, closure))
    cell = cells.get("func")
    function = cell.cell_contents if cell is not None else None
    return function if inspect.isfunction(function) else None


def _made_in_forward(tracer: fx.Tracer, module: nn.Module) -> bool:
    """A stateless module made by a layer's code as it runs, not a submodule of the model.

    transformers 4 makes its loss that way (`loss_fct = CrossEntropyLoss()` in `forward`); it
    holds no weights, so it is traced through as the function it computes.
    """
    try:
        tracer.path_of_module(module)
    except NameError:
        return next(iter(module.parameters()), None) is None and next(
            iter(module.buffers()), None) is None
    return False


def _plain(function: Callable[..., Any]) -> Callable[..., Any]:
    return function_behind(function) or function


# The oldest and the newest transformers release that unit_scale is tested on (CI runs its
# Hugging Face tests on both): 4.29.2 is Optimum Graphcore's pin. Of transformers 5, releases
# from 5.19 are supported (tested on 5.19.0 too; 5.17 and 5.18 leave Llama's rotary embedding
# untraceable), up to, not including, the next major version after the newest. Releases from
# 4.30 to 5.18 are untested and refused. setup.py and docs/guide/install.md say the same.
TRANSFORMERS_TESTED = ("4.29.2", "5.25.0")
TRANSFORMERS_5_OLDEST = "5.19.0"


def _minor_version(version: str) -> Tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def _transformers_version() -> str:
    # Read at each call: transformers may replace its module in sys.modules as it loads a model.
    return str(getattr(sys.modules.get("transformers"), "__version__", "unknown"))


def transformers_unsupported(model: nn.Module) -> Optional[str]:
    """Why unit_scale cannot convert `model`, a Hugging Face model, with the installed
    transformers; None when it can (or when `model` has no transformers layers).

    Each transformers release may change how its models are written (transformers 5 turned
    functions into modules), which decides what the tracer sees; a release outside the tested
    range is refused rather than converted halfway.
    """
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return None
    version = _transformers_version()
    oldest, newest = TRANSFORMERS_TESTED
    minor, next_major = _minor_version(version), _minor_version(newest)[0] + 1
    if minor == _minor_version(oldest) or (
            _minor_version(TRANSFORMERS_5_OLDEST) <= minor < (next_major, 0)):
        return None
    newer = ">={}.{},<{}".format(*_minor_version(TRANSFORMERS_5_OLDEST), next_major)
    return (f"unit_scale supports transformers {'.'.join(oldest.split('.')[:2])}.* and "
            f"{newer} (tested on {oldest}, {TRANSFORMERS_5_OLDEST} and {newest}); this is "
            f'transformers {version}: pip install "transformers{newer}"')


# Tensor factories whose arguments are often traced values: `torch.arange(x.shape[-1],
# device=x.device)`, `torch.zeros(batch, width)`.
_FACTORY_FUNCTIONS = (
    "arange", "empty", "eye", "full", "linspace", "logspace", "ones", "rand", "randint", "randn",
    "randperm", "scalar_tensor", "tensor", "zeros",
)


@contextlib.contextmanager
def _factories_accept_proxies() -> Iterator[None]:
    """While tracing, record a tensor factory called with traced arguments as a graph node.

    Torch 2.0's factories reject an `fx.Proxy` argument with a TypeError (later versions hand
    it to fx through `__torch_function__`), so every model that builds positions from its
    input's length would be untraceable there. The node's target is the original function, so
    the graph is the same on every torch version.
    """
    originals = {
        name: getattr(torch, name) for name in _FACTORY_FUNCTIONS
        if not hasattr(getattr(torch, name), "_records_proxies")  # not already, by an outer trace
    }

    def accepting_proxies(factory: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(factory)
        def call(*args: Any, **kwargs: Any) -> Any:
            leaves = pytree.tree_flatten((args, kwargs))[0]
            proxies = [leaf for leaf in leaves if isinstance(leaf, fx.Proxy)]
            if proxies:
                return proxies[0].tracer.create_proxy("call_function", factory, args, kwargs)
            return factory(*args, **kwargs)

        call._records_proxies = True  # type: ignore[attr-defined]
        return call

    for name, factory in originals.items():
        setattr(torch, name, accepting_proxies(factory))
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)


@contextlib.contextmanager
def _type_info_of_traced_dtypes(tracer: ConcreteTracer) -> Iterator[None]:
    """While tracing, `torch.finfo(x.dtype)` answers for the dtype `x` has on the example inputs.

    transformers 4 builds its masks' fill value as `torch.finfo(embeddings.dtype).min`, where the
    dtype is a traced value. The limit becomes a constant of the graph, as it is of an eager call.
    """
    originals = {"finfo": torch.finfo, "iinfo": torch.iinfo}

    def answering(info: Any) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            known = [tracer.concrete_value(a.node) if isinstance(a, fx.Proxy) else a for a in args]
            return info(*known)
        return call

    for name, info in originals.items():
        setattr(torch, name, answering(info))
    try:
        yield
    finally:
        for name, info in originals.items():
            setattr(torch, name, info)


def _carries_data(value: Any) -> bool:
    """A floating-point tensor, or a container holding one.

    Integer tensors (positions, masks, indices) and shapes carry no scale to speak of.
    """
    return any(
        isinstance(leaf, Tensor) and leaf.is_floating_point()
        for leaf in pytree.tree_flatten(value)[0]  # tree_leaves is missing from torch 2.0
    )


class _ConcreteProxy(fx.Proxy):
    """A proxy whose `len()` is its length on the example inputs."""

    def __len__(self) -> int:
        tracer = self.tracer
        if isinstance(tracer, ConcreteTracer):
            return len(tracer.concrete_value(self.node))
        return super().__len__()


# Module.__call__ as it was before fx patched it for tracing.
_unpatched_module_call = getattr(fx._symbolic_trace, "_orig_module_call", nn.Module.__call__)


def _get_attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def capture_inputs(
    model: nn.Module, args: Sequence[Any], kwargs: Optional[Dict[str, Any]] = None
) -> Dict[str, Inputs]:
    """Run `model(*args, **kwargs)` once and return the first inputs each submodule saw."""
    seen: Dict[str, Inputs] = {}
    handles = []
    for name, module in model.named_modules():

        def record(module: nn.Module, a: Tuple[Any, ...], k: Dict[str, Any], name: str = name):
            seen.setdefault(name, (tuple(a), dict(k)))

        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **(kwargs or {}))
    finally:
        for handle in handles:
            handle.remove()
    return seen


_PLAIN_TYPES = (type(None), bool, int, float, str)


def _plain_containers(value: Any) -> Any:
    """`value` with fx's immutable lists and dicts (a traced call's arguments hold them, such
    as transformers 4's per-layer `head_mask`) made the plain ones a caller passes."""
    immutable = fx.immutable_collections
    if type(value) in (list, tuple, immutable.immutable_list):
        items = [_plain_containers(item) for item in value]
        return tuple(items) if type(value) is tuple else items
    if type(value) in (dict, immutable.immutable_dict):
        return {key: _plain_containers(item) for key, item in value.items()}
    return value


class ArgumentFrame(nn.Module):
    """Calls `inner` with one call's arguments, its tensors taken as positional inputs.

    Tracing a frame gives a graph whose inputs are exactly the call's tensors, wherever they sat
    (positional, keyword or inside `**kwargs`); every other argument is a constant of the graph.
    """

    def __init__(self, inner: nn.Module, inputs: Inputs) -> None:
        super().__init__()
        self.inner = inner
        self.signature = inspect.signature(inner.forward)
        bound = self.signature.bind(*inputs[0], **inputs[1])
        bound.apply_defaults()
        arguments = {name: _plain_containers(value) for name, value in bound.arguments.items()}
        leaves, self.spec = pytree.tree_flatten(arguments)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        self.example_tensors = [leaves[i] for i in self.tensor_positions]
        self.constants = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]

    def call_arguments(self, tensors: Sequence[Any]) -> Inputs:
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        arguments = pytree.tree_unflatten(leaves, self.spec)
        args: List[Any] = []
        kwargs: Dict[str, Any] = {}
        for name, value in arguments.items():
            kind = self.signature.parameters[name].kind
            if kind == inspect.Parameter.POSITIONAL_ONLY:
                args.append(value)
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                args.extend(value)
            elif kind == inspect.Parameter.VAR_KEYWORD:
                kwargs.update(value)
            else:
                kwargs[name] = value
        return tuple(args), kwargs

    def forward(self, *tensors: Any) -> Any:
        args, kwargs = self.call_arguments(tensors)
        result = self.inner(*args, **kwargs)
        # fx turns a returned dict subclass (such as a Hugging Face ModelOutput) into a dict.
        self.output_type = type(result)
        return result


class SpecialisedCall(nn.Module):
    """Takes the original module's arguments and runs the traced graph on their tensors.

    Non-tensor arguments were fixed when the graph was traced; a call that changes a None,
    bool, number or string among them is refused rather than silently run on the old value.
    """

    def __init__(
        self, graph_module: nn.Module, frame: ArgumentFrame,
        fixed_shapes: Optional[List[Tuple[Optional[int], ...]]] = None,
    ) -> None:
        super().__init__()
        self.graph_module = graph_module
        # Per tensor argument, the sizes the tracer fixed (None: free to change); torch.export
        # fixes the sizes a model's code pins down, fx none.
        self._fixed_shapes = fixed_shapes
        self._signature = frame.signature
        self._spec = frame.spec
        self._tensor_positions = frame.tensor_positions
        self._constants = frame.constants
        self._output_type = getattr(frame, "output_type", None)

    @property
    def signature(self) -> inspect.Signature:
        """The original module's forward's signature, which calls are bound to."""
        return self._signature

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        leaves, spec = pytree.tree_flatten(dict(bound.arguments))
        if spec != self._spec:
            raise ValueError(
                "unit_scale specialised this module to the structure of its example arguments; "
                f"got a different structure: {spec}"
            )
        for position, (leaf, constant) in enumerate(zip(leaves, self._constants)):
            if position in self._tensor_positions:
                if not isinstance(leaf, Tensor):
                    raise ValueError(f"argument {position} was a tensor when traced, not {leaf!r}")
            elif isinstance(constant, _PLAIN_TYPES) and leaf != constant:
                raise ValueError(
                    f"unit_scale specialised this module to the argument value {constant!r}; "
                    f"got {leaf!r}"
                )
        tensors = [leaves[i] for i in self._tensor_positions]
        if self._fixed_shapes is not None:
            _check_shapes(tensors, self._fixed_shapes)
        result = self.graph_module(*tensors)
        output_type = self._output_type
        if type(result) is dict and output_type is not None and issubclass(output_type, dict):
            return output_type(**result)
        return result


def _check_shapes(tensors: Sequence[Tensor], fixed: Sequence[Tuple[Optional[int], ...]]) -> None:
    for position, (tensor, sizes) in enumerate(zip(tensors, fixed)):
        wrong = len(tensor.shape) != len(sizes) or any(
            size is not None and size != actual for size, actual in zip(sizes, tensor.shape)
        )
        if wrong:
            shown = tuple("*" if size is None else size for size in sizes)
            raise ValueError(
                f"unit_scale traced this module with torch.export, which fixed the shape of "
                f"tensor argument {position} to {shown} (* is free); got {tuple(tensor.shape)}"
            )


def trace_module(
    module: nn.Module, is_leaf: Callable[[nn.Module, str], bool], inputs: Optional[Inputs],
    autowrap: Tuple[Callable[..., Any], ...] = (),
) -> Tuple[nn.Module, fx.Graph, List[str], Optional[Set[str]]]:
    """Trace `module`, through an `ArgumentFrame` when example inputs are given.

    Returns the traced root (the module or its frame, whose submodule names start with
    "inner."), its graph, the nodes whose values fixed a branch, and the names of the nodes that
    produced tensors on the example inputs (None without inputs).
    """
    if inputs is None:
        tracer = ConcreteTracer(is_leaf, autowrap)
        graph = tracer.trace_with_inputs(module, None, {})
        return module, graph, tracer.specialised, tracer.tensor_nodes
    frame = ArgumentFrame(module, inputs)

    def frame_is_leaf(m: nn.Module, name: str) -> bool:
        return name != "inner" and is_leaf(m, name[len("inner."):])

    tracer = ConcreteTracer(frame_is_leaf, autowrap)
    # One `*tensors` placeholder; the tracer's `iter` splits it by the example's length.
    graph = tracer.trace_with_inputs(frame, {"tensors": tuple(frame.example_tensors)}, None)
    return frame, graph, tracer.specialised, tracer.tensor_nodes

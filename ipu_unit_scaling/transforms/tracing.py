"""torch.fx tracing that resolves Python control flow from example inputs.

Plain `torch.fx.symbolic_trace` stops at the first `if` on a traced value (a shape check, an
`is_nested` test, a mask that may be absent). `ConcreteTracer` runs every node on real example
values as it records it, so such a condition is answered by its value on the example inputs and
the traced graph is specialised to that branch. Non-tensor arguments are baked into the graph the
same way (fx adds a guard for None, bool and number arguments).
"""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch import Tensor, nn

__all__ = ["ConcreteTracer", "capture_inputs", "trace_module", "Inputs"]

# (args, kwargs) of one call.
Inputs = Tuple[Tuple[Any, ...], Dict[str, Any]]

_UNKNOWN = object()
_CONCRETE_PLACEHOLDER = re.compile(r"^(.*)_\d+$")


class ConcreteTracer(fx.Tracer):
    """An fx tracer with a leaf policy and concrete values for control flow.

    `is_leaf(module, qualified_name)` decides which modules become single `call_module` nodes;
    every other module, including `torch.nn` containers and layers such as
    `nn.TransformerEncoderLayer`, is traced through.
    """

    def __init__(self, is_leaf: Callable[[nn.Module, str], bool]) -> None:
        super().__init__()
        self._is_leaf = is_leaf
        self._inputs: Dict[str, Any] = {}
        self._values: Dict[fx.Node, Any] = {}
        self.specialised: List[str] = []
        self.tensor_nodes: Optional[Set[str]] = None
        self._real_attributes = False

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        if self._real_attributes:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self._is_leaf(m, module_qualified_name)

    def trace_with_inputs(
        self, root: nn.Module, inputs: Optional[Dict[str, Any]], concrete_args: Dict[str, Any]
    ) -> fx.Graph:
        self._inputs = dict(inputs or {})
        self._values = {}
        try:
            graph = self.trace(root, concrete_args=concrete_args or None)
            if self._inputs:
                self.tensor_nodes = {
                    node.name for node, value in self._values.items() if isinstance(value, Tensor)
                }
            return graph
        finally:
            self._values = {}

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):  # type: ignore[no-untyped-def]
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if self._inputs:
            self._values[node] = self._evaluate(node)
        return node

    def _evaluate(self, node: fx.Node) -> Any:
        if node.op == "placeholder":
            name = str(node.target).lstrip("*")
            if name in self._inputs:
                return self._inputs[name]
            match = _CONCRETE_PLACEHOLDER.match(name)
            if match and match.group(1) in self._inputs:
                return self._inputs[match.group(1)]
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

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self._values.get(obj.node, _UNKNOWN)
        if value is _UNKNOWN:
            raise fx.proxy.TraceError(
                f"control flow depends on {obj.node.name!r}, whose value is unknown: pass "
                "example inputs so that it can be resolved"
            )
        self.specialised.append(obj.node.name)
        return bool(value)

    def iter(self, obj: fx.Proxy):  # type: ignore[no-untyped-def]
        value = self._values.get(obj.node, _UNKNOWN)
        if isinstance(value, (tuple, list, torch.Size)):
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)


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


def bind_inputs(module: nn.Module, inputs: Inputs) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(all values by parameter name, the non-tensor ones to bake into the graph)."""
    signature = inspect.signature(inspect.unwrap(module.forward))
    bound = signature.bind(*inputs[0], **inputs[1])
    bound.apply_defaults()
    values: Dict[str, Any] = {}
    concrete: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError("modules called with extra *args cannot be traced")
            continue
        if kind == inspect.Parameter.VAR_KEYWORD:
            values.update(value)
            for key, item in value.items():
                if not isinstance(item, Tensor):
                    raise TypeError(f"non-tensor **kwargs entry {key!r} cannot be traced")
            continue
        values[name] = value
        if not isinstance(value, Tensor):
            concrete[name] = value
    return values, concrete


def trace_module(
    module: nn.Module, is_leaf: Callable[[nn.Module, str], bool], inputs: Optional[Inputs]
) -> Tuple[fx.Graph, List[str], Optional[Set[str]]]:
    """Trace `module`.

    Returns its graph, the nodes whose values fixed a branch, and the names of the nodes that
    produced tensors on the example inputs (None without inputs).
    """
    tracer = ConcreteTracer(is_leaf)
    if inputs is None:
        graph = tracer.trace_with_inputs(module, None, {})
    else:
        values, concrete = bind_inputs(module, inputs)
        graph = tracer.trace_with_inputs(module, values, concrete)
    return graph, tracer.specialised, tracer.tensor_nodes

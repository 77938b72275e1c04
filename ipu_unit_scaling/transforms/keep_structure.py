"""Conversions that keep a model's module structure, for libraries that walk, rebuild and reload
it (Optimum Graphcore's `to_pipelined`, `parallelize` and `deparallelize`; PopTorch's blocks).

`unit_scale(model, keep_structure=True)` gives a copy with the same modules under the same
names: each traced module keeps its class, attributes and children and gets its converted
forward as an instance attribute (`ConvertedForward`), which looks its submodules and
parameters up on the module at every call, so a hook or a replacement put on them later (a
`poptorch.BeginBlock`, a serialised embedding) takes effect. The state dict keeps the model's
keys. Modules are traced down to repeated blocks: a module holding a `ModuleList` (a trunk:
`BertModel`, `GPT2Model`) calls its children as modules, and each block (`BertLayer`,
`GPT2Block`) is traced whole, so that residuals inside it are found and the blocks a pipeline
is split at stay modules.

A converted Hugging Face model (a `PreTrainedModel`) gets a subclass of its class, named after
the conversion (`UnitScaledBertForSequenceClassification`): code that rebuilds a model from its
config and reloads its state dict (Optimum's `to_pipelined` for a transformers class) would
drop the conversion without a word; it looks the class up instead and refuses in one line,
while `isinstance(model, BertForSequenceClassification)` still holds.
"""
from __future__ import annotations

import copy
import inspect
import itertools
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch import nn

from .export import module_path
from .fx_tracing import SpecialisedCall

__all__ = ["ConvertedForward", "install_forward", "inlined_blocks", "is_trunk", "is_trunk_leaf",
           "mark_converted"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
_counter = itertools.count()


def is_trunk(module: nn.Module) -> bool:
    """Whether `module` holds repeated blocks: a `ModuleList` or `ModuleDict` below it."""
    return any(isinstance(m, _CONTAINERS) for m in itertools.islice(module.modules(), 1, None))


def is_trunk_leaf(trunk: nn.Module, relative: str) -> bool:
    """Whether the submodule at `relative` is called as a module when `trunk` is traced: a
    child, or an element of a container child (`layer.0`)."""
    parts = relative.split(".")
    parent = trunk
    for part in parts[:-1]:
        parent = getattr(parent, part)
        if not isinstance(parent, _CONTAINERS):
            return False
    return True


def inlined_blocks(module: nn.Module, graph: fx.Graph) -> List[str]:
    """The blocks of the trunk `module` (see `is_trunk_leaf`) whose ops `graph`, its
    torch.export trace, runs inline instead of calling them as modules (export's outlining
    gives up on some regions): hooks on them would not fire."""
    blocks = [path for path, _ in module.named_modules()
              if path and not isinstance(_lookup(module, path), _CONTAINERS)
              and is_trunk_leaf(module, path)]
    inlined: List[str] = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        path = module_path(node)
        for block in blocks:
            if (path == block or path.startswith(block + ".")) and block not in inlined:
                inlined.append(block)
    return inlined


class _LiveSelf:
    """`self` of the graph's code: the module, and the few values of the graph module's own
    that its code reads (torch.export's input and output specs)."""

    def __init__(self, module: nn.Module, extras: Dict[str, Any]) -> None:
        self._module, self._extras = module, extras

    def __getattr__(self, name: str) -> Any:
        extras = self.__dict__["_extras"]
        if name in extras:
            return extras[name]
        return getattr(self.__dict__["_module"], name)


class _BoundGraph:
    """The converted graph's code bound to the live module (what `SpecialisedCall` calls)."""

    def __init__(self, forward: ConvertedForward) -> None:
        self.forward = forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward.run(*args, **kwargs)


class ConvertedForward:
    """A converted module's forward: its rewritten graph's code run against the module itself.

    Held in the module's `__dict__` as `forward`, so it wins over the class's forward (also
    after a library swaps the class, as Optimum does for BERT's attention). A deep copy of the
    module gets one bound to the copy.
    """

    def __init__(self, module: nn.Module, code: Any, extras: Dict[str, Any],
                 specialised: Optional[SpecialisedCall], graph: Optional[fx.Graph] = None
                 ) -> None:
        self.module = module
        self.code = code
        self.graph = graph  # what `code` was generated from
        self.extras = extras
        self.specialised = specialised
        if specialised is not None:
            # not a submodule: the graph's modules are the module's own
            specialised._modules.pop("graph_module", None)
            object.__setattr__(specialised, "graph_module", _BoundGraph(self))

    @property
    def __signature__(self) -> inspect.Signature:
        # What callers that bind by name read (PopTorch binds a call's keyword arguments to
        # the forward's parameters): the original forward's, not (*args, **kwargs).
        if self.specialised is not None:
            return self.specialised.signature
        parameters = list(inspect.signature(self.code).parameters.values())
        return inspect.Signature(parameters[1:])  # without the module itself

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.specialised is not None:
            return self.specialised(*args, **kwargs)
        return self.run(*args, **kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The graph's code on the graph's own inputs."""
        return self.code(_LiveSelf(self.module, self.extras), *args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> ConvertedForward:
        new = ConvertedForward.__new__(ConvertedForward)
        memo[id(self)] = new
        new.module = copy.deepcopy(self.module, memo)
        new.code = self.code
        new.graph = self.graph
        new.extras = copy.deepcopy(self.extras, memo)
        new.specialised = copy.deepcopy(self.specialised, memo)  # bound to `new` through memo
        return new

    def __reduce__(self) -> Any:
        raise TypeError("a model converted with keep_structure=True pickles through its "
                        "state_dict(), not whole: its forward is generated code")


def install_forward(module: nn.Module, converted: nn.Module) -> nn.Module:
    """`module` itself, its forward `converted`'s (the GraphModule, or the SpecialisedCall, that
    the conversion of `module` built), reading its submodules from `module` at each call."""
    specialised = converted if isinstance(converted, SpecialisedCall) else None
    graph_module = converted.graph_module if specialised is not None else converted
    assert isinstance(graph_module, fx.GraphModule)
    # A frame's graph reaches the module as "inner"; other targets are the frame's or new.
    prefix = "inner." if specialised is not None else ""
    names = _names_by_identity(module)
    graph = graph_module.graph
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        value = _lookup(graph_module, target)
        live = target[len(prefix):] if target.startswith(prefix) else None
        if live is not None and _lookup(module, live, None) is value:
            node.target = live
        elif id(value) in names:
            node.target = names[id(value)]
        else:
            node.target = names[id(value)] = _attach(module, target, value)
    rebuilt = fx.GraphModule(module, graph, class_name=type(graph_module).__name__)
    code = type(rebuilt).forward
    extras = {name: value for name, value in graph_module.__dict__.items()
              if name not in _MODULE_STATE and not isinstance(value, (nn.Module, torch.Tensor))}
    module.__dict__["forward"] = ConvertedForward(module, code, extras, specialised,
                                                   graph)
    return module


# What every module has in its __dict__ (the graph module's own values are the rest).
_MODULE_STATE = frozenset(nn.Module().__dict__) | {"graph", "_graph", "_code", "code"}


def _names_by_identity(module: nn.Module) -> Dict[int, str]:
    names: Dict[int, str] = {}
    for kind in (module.named_modules(), module.named_parameters(), module.named_buffers()):
        for name, value in kind:
            names.setdefault(id(value), name)
    return names


_MISSING = object()


def _lookup(root: Any, target: str, default: Any = _MISSING) -> Any:
    value = root
    for atom in target.split(".") if target else ():
        value = getattr(value, atom, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise AttributeError(f"no attribute {target!r}")
            return default
    return value


def _attach(module: nn.Module, target: str, value: Any) -> str:
    """Put a value the rewrite added (a dropout module, a constant tensor) on `module`: modules
    as children (so that train() and eval() reach them), tensors as non-persistent buffers (so
    that .half() and .to() move them and the state dict keeps its keys)."""
    name = f"unit_{target.replace('.', '_')}_{next(_counter)}"
    if isinstance(value, nn.Module):
        module.add_module(name, value)
    elif isinstance(value, nn.Parameter):
        raise ValueError(f"unit_scale: the converted graph reads a parameter {target!r} that is "
                         "not the model's own")
    elif isinstance(value, torch.Tensor):
        module.register_buffer(name, value, persistent=False)
    else:
        setattr(module, name, value)
    return name


def mark_converted(model: nn.Module, prefix: str) -> None:
    """Give a Hugging Face model (one with a `config` and `from_pretrained`) a subclass of its
    class named `prefix + name` (see the module docstring); other modules keep theirs."""
    cls = type(model)
    if not (hasattr(cls, "from_pretrained") and hasattr(model, "config")):
        return
    if cls.__name__.startswith(prefix):
        return
    model.__class__ = _subclass(cls, prefix)


_SUBCLASSES: Dict[Tuple[type, str], type] = {}


def _subclass(cls: type, prefix: str) -> type:
    key = (cls, prefix)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,),
                                {"__module__": cls.__module__})
    return _SUBCLASSES[key]

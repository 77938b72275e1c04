"""A model converted without example inputs keeps its object, and converts a call of another
structure when it first comes.

`unit_scale(model)` without example inputs traces the model with every argument a traced value.
Python code that tests an optional argument (`if targets is not None:`) then takes the branch of
a given argument, so the traced graph serves only calls that pass every argument. The returned
model is the model's own object (its class, attributes and methods: nanoGPT's `config`,
`configure_optimizers` and `generate`), its converted layers in place of the originals under the
same names, and its forward a `CallStructures`: calls that pass every argument run the graph
traced at conversion; a call that leaves an argument None, or passes a number, a string or a
flag, is traced on its own arguments the first time its structure (which arguments are tensors,
which are None, the other values) comes, and converted with the same rules, reusing the
converted layers: no new parameters. unit-scaling's `unit_scale` (TorchDynamo) converts each call
structure when it first comes too.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Hashable, Iterator, Optional, Tuple

import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .fx_tracing import Inputs
from .graph import set_submodule
from .keep_structure import ConvertedForward, install_forward

__all__ = ["CallStructures", "keep_root"]

# Converts the model for one call's arguments: a GraphModule or SpecialisedCall of the model.
ConvertCall = Callable[[nn.Module, Inputs], nn.Module]


def keep_root(root: nn.Module, converted: fx.GraphModule, convert_call: ConvertCall) -> nn.Module:
    """`root` itself, with `converted`'s layers put at their paths and `converted` as the forward
    of calls that pass every argument (see the module docstring)."""
    _graft(root, converted)
    install_forward(root, converted)
    traced = root.__dict__.pop("forward")
    assert isinstance(traced, ConvertedForward)
    root.__dict__["forward"] = CallStructures(root, traced, convert_call)
    return root


def _graft(root: nn.Module, converted: fx.GraphModule) -> None:
    """Each module a node of `converted` calls or reads, put at the same path of `root` (the
    path it had in the model), so that the state dict keeps the model's keys."""
    for node in converted.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        path = str(node.target)
        owner, _, attribute = path.rpartition(".")
        try:
            live_owner = root.get_submodule(owner) if owner else root
        except AttributeError:
            continue  # a module the rewrite added: install_forward attaches it
        value = (converted.get_submodule(path) if node.op == "call_module"
                 else getattr(converted.get_submodule(owner), attribute))
        if getattr(live_owner, attribute, None) is not value:
            if node.op == "call_module":
                set_submodule(root, path, value)
            elif hasattr(live_owner, attribute):
                setattr(live_owner, attribute, value)


class CallStructures:
    """A converted model's forward, converting each new call structure at its first call."""

    def __init__(self, module: nn.Module, traced: ConvertedForward,
                 convert_call: ConvertCall) -> None:
        self.module = module
        self.traced = traced
        self.convert_call = convert_call
        self.signature = inspect.signature(type(module).forward)
        self.converted: Dict[Hashable, ConvertedForward] = {}

    @property
    def __signature__(self) -> inspect.Signature:
        return self.traced.__signature__

    @property
    def graph(self) -> Optional[fx.Graph]:
        """The converted graph of calls that pass every argument."""
        return self.traced.graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.for_call(args, kwargs)(*args, **kwargs)

    def for_call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> ConvertedForward:
        """The converted forward that serves a call with these arguments."""
        bound = self.signature.bind(self.module, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(list(bound.arguments.items())[1:])  # without the module itself
        leaves, spec = pytree.tree_flatten(arguments)
        if all(isinstance(leaf, Tensor) for leaf in leaves):
            return self.traced
        key = (str(spec), tuple(_structure(leaf) for leaf in leaves))
        if key not in self.converted:
            with _class_forward(self.module):
                converted = self.convert_call(self.module, (args, kwargs))
                install_forward(self.module, converted)
                made = self.module.__dict__.pop("forward")
            assert isinstance(made, ConvertedForward)
            self.converted[key] = made
        return self.converted[key]

    def __deepcopy__(self, memo: Dict[int, Any]) -> CallStructures:
        import copy

        new = CallStructures.__new__(CallStructures)
        memo[id(self)] = new
        new.module = copy.deepcopy(self.module, memo)
        new.traced = copy.deepcopy(self.traced, memo)
        new.convert_call = self.convert_call
        new.signature = self.signature
        new.converted = {key: copy.deepcopy(value, memo) for key, value in self.converted.items()}
        return new

    def __reduce__(self) -> Any:
        raise TypeError("a model converted by unit_scale pickles through its state_dict(), "
                        "not whole: its forward is generated code")


def _structure(leaf: Any) -> Hashable:
    if isinstance(leaf, Tensor):
        return ("tensor", leaf.dim(), leaf.dtype)
    try:
        hash(leaf)
    except TypeError:
        return ("object", type(leaf).__qualname__)
    return ("value", type(leaf).__qualname__, leaf)


@contextlib.contextmanager
def _class_forward(module: nn.Module) -> Iterator[None]:
    """While tracing the module again, its class's forward is its forward."""
    own = module.__dict__.pop("forward")
    try:
        yield
    finally:
        module.__dict__["forward"] = own

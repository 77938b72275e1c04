"""Composable graph transforms of a module's forward pass, captured by TorchDynamo.

`apply_transform(module, backend)` returns a copy of `module` whose forward pass is captured as
torch.fx graphs by TorchDynamo the first time it runs, each graph passed through `backend`
(a `torch.compile` backend: `(graph_module, example_inputs) -> callable`). Applied to a module
that already carries transforms, the new backend runs after the earlier ones, so transforms nest:
`compile(simulate_fp8(module))`. The graph is captured again after `torch._dynamo.reset()`, which
a new transform does on its first call (so many transformed copies of one class never exhaust
Dynamo's cache of compiled frames).

Captured graphs inline torch.nn modules (TorchDynamo does so from torch 2.1: a linear layer is an
`F.linear` call); graph breaks give several graphs, each through the backends.

`compile(module)` is the transform that runs TorchInductor last (what `torch.compile` does),
composable with the others; `torch.compile` itself cannot wrap a transformed module.

These are unit_scaling's transform API; `ipu_unit_scaling.transforms.unit_scale`, this package's
conversion, traces with torch.fx instead and returns a module that needs no capture. The helpers
a backend is written with (`replace_node_with_function`) and unit_scaling's two switches for
capturing through torch.nn (`torch_nn_modules_to_user_modules`, `patch_to_expand_modules`) are
here too; its module path for them is `ipu_unit_scaling.transforms.utils`.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from torch import Tensor, fx, nn

from ..ops.scaling_primitive import scales_as_one_op
from ..ops.torch_arguments import T

__all__ = ["Backend", "M", "apply_transform", "transforms_of", "without_transforms",
           "compile", "replace_node_with_function", "torch_nn_modules_to_user_modules",
           "patch_to_expand_modules"]

Backend = Callable[[fx.GraphModule, List[Tensor]], Callable[..., Any]]
M = TypeVar("M", bound=nn.Module)


def _dynamo() -> Any:
    try:
        import torch._dynamo as dynamo
    except ImportError as error:  # pragma: no cover - torch builds without Dynamo
        raise RuntimeError(f"graph transforms need TorchDynamo: {error}") from error
    return dynamo


class _TransformedForward:
    """The forward of a transformed module: its own forward, captured through `backends`.

    Held in the module's `__dict__` as `forward`; a deep copy of the module gets one bound to
    the copy, to be captured again.
    """

    def __init__(self, module: nn.Module, base_forward: Callable[..., Any],
                 backends: Tuple[Backend, ...]) -> None:
        self.module = module
        self.base_forward = base_forward
        self.backends = backends
        # per forward captured: the module's own, or one per call structure of a model
        # unit_scale converted without example inputs (see call_structures)
        self._compiled: Dict[int, Callable[..., Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target = self.base_forward
        for_call = getattr(target, "for_call", None)
        if for_call is not None:  # converting a new call structure traces: not under capture
            target = for_call(args, kwargs)
        compiled = self._compiled.get(id(target))
        if compiled is None:
            dynamo = _dynamo()
            if not self._compiled:
                dynamo.reset()
            compiled = dynamo.optimize(_composed(self.backends))(target)
            self._compiled[id(target)] = compiled
        if self.backends and self.backends[-1] is _inductor:
            return compiled(*args, **kwargs)  # (Inductor fuses the scales' Functions itself)
        with scales_as_one_op():
            return compiled(*args, **kwargs)

    def __deepcopy__(self, memo: Dict[int, Any]) -> _TransformedForward:
        module = copy.deepcopy(self.module, memo)
        base_forward = copy.deepcopy(self.base_forward, memo)  # rebinds to the copy
        return _TransformedForward(module, base_forward, self.backends)


def _composed(backends: Sequence[Backend]) -> Backend:
    def composite(gm: fx.GraphModule, example_inputs: List[Tensor]) -> Callable[..., Any]:
        result: Any = gm
        for backend in backends:
            result = backend(result, example_inputs)
        return result  # type: ignore[no-any-return]

    return composite


def transforms_of(module: nn.Module) -> Tuple[Backend, ...]:
    """The backends applied to `module` by `apply_transform`, first to last (none: `()`)."""
    forward = module.__dict__.get("forward")
    return forward.backends if isinstance(forward, _TransformedForward) else ()


def without_transforms(module: M) -> M:
    """`module` itself with its own forward again (the transforms dropped), in place."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, _TransformedForward):
        del module.__dict__["forward"]
    return module


def apply_transform(module: M, backend: Backend,
                    non_recurse_functions: Sequence[Callable[..., Any]] = ()) -> M:
    """A copy of `module` whose forward graphs pass through `backend` after any earlier
    transforms' backends (see the module docstring).

    `non_recurse_functions` are captured as single calls (`torch._dynamo.allow_in_graph`)
    instead of being traced through, so that a backend can find and replace them.
    """
    dynamo = _dynamo()
    copied = copy.deepcopy(module)
    if isinstance(copied, fx.GraphModule):
        copied = _as_plain_module(copied)  # type: ignore[assignment]
    earlier = transforms_of(copied)
    without_transforms(copied)
    for function in non_recurse_functions:
        dynamo.allow_in_graph(function)
    copied.__dict__["forward"] = _TransformedForward(copied, copied.forward, (*earlier, backend))
    # unit-scaling's record of what a module carries, which scripts read to name a run.
    copied.backends = [*getattr(module, "backends", ()), backend]  # type: ignore[assignment]
    return copied


def _as_plain_module(gm: fx.GraphModule) -> nn.Module:
    """`gm`'s modules, parameters and generated forward in a module of a plain class.

    `copy.copy` rebuilds a GraphModule from its graph, leaving out a forward set on the
    instance, and PopTorch's `trainingModel` and `inferenceModel` copy the model so: a
    transformed GraphModule would train without its transforms. A plain module's copy keeps
    them; its parameter names are the GraphModule's.
    """
    kind = type(type(gm).__name__, (nn.Module,), {"forward": type(gm).forward})
    plain: nn.Module = nn.Module.__new__(kind)
    plain.__dict__.update(gm.__dict__)
    return plain


def _inductor(gm: fx.GraphModule, example_inputs: List[Tensor]) -> Callable[..., Any]:
    return _dynamo().lookup_backend("inductor")(gm, example_inputs)  # type: ignore[no-any-return]


def compile(module: M) -> M:  # noqa: A001 - unit_scaling's name for it
    """A copy of `module` compiled by TorchInductor after its other transforms (the
    composable `torch.compile`); apply it last."""
    return apply_transform(module, _inductor)


def replace_node_with_function(graph: fx.Graph, source: fx.Node, target_fn: Callable[..., Any],
                               args: Optional[Tuple[Any, ...]] = None,
                               kwargs: Optional[Dict[str, Any]] = None,
                               keep_type_expr: bool = True) -> None:
    """Put a call of `target_fn` in place of `source` in `graph`: with `source`'s arguments
    unless `args` / `kwargs` are given, and its type annotation unless `keep_type_expr` is
    False. Every user of `source` reads the new node; `source` is erased."""
    type_expr = source.type if keep_type_expr else None
    with graph.inserting_after(source):
        node = graph.call_function(target_fn, source.args if args is None else args,
                                   source.kwargs if kwargs is None else kwargs, type_expr)
    source.replace_all_uses_with(node)
    graph.erase_node(source)


def torch_nn_modules_to_user_modules(module: nn.Module) -> None:
    """Make every `torch.nn` submodule of `module` (at any depth) an instance of a trivial
    subclass defined outside `torch.nn`, in place, keeping its state.

    TorchDynamo before torch 2.1 captured a `torch.nn` module as one call; a user module it
    traces through, so backends see the functions inside (`F.linear`, ...). From torch 2.1 it
    traces through `torch.nn` modules anyway; the subclasses change nothing else.
    """
    for name, child in module.named_children():
        torch_nn_modules_to_user_modules(child)
        kind = type(child)
        if not kind.__module__.startswith(("torch.nn.", "torch.ao.")):
            continue
        where = kind.__module__.replace("torch.nn.", "", 1).replace(".", "_")
        subclass = type(f"trivial_subclass_{where}_{kind.__name__}", (kind,), {})
        converted: nn.Module = nn.Module.__new__(subclass)
        converted.__dict__.update(child.__dict__)
        setattr(module, name, converted)


def patch_to_expand_modules(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` (a TorchDynamo-optimised forward), capturing through `torch.nn` modules and
    functions rather than as single calls.

    unit_scaling patched a check of TorchDynamo's for this; the torch versions this package's
    graph transforms run on (2.1 and later) trace through `torch.nn` already, so `fn` is
    returned as it is, wrapped to keep its name and docstring.
    """

    @functools.wraps(fn)
    def expanded(*args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)

    return expanded

"""What the PopTorch stand-in's ``poptorch.custom_op`` runs: the op libraries' host numerics.

On an IPU a program loads an op library (``ctypes.cdll.LoadLibrary``), which registers its ops
with PopART, and calls them through ``poptorch.custom_op(inputs, name, domain, ...)``. The
stand-in has no PopART: an op library registers each op's numerics here instead, a function of
the op's inputs and attributes that returns its outputs (:func:`register_op`). A call is one op
of the traced graph, as PopART's op is: the ops inside the numerics are not checked against
PopTorch's handlers.

An op whose numerics are a ``torch.library`` op (one graph node with its own autograd kernel,
as the PopART op has its grad op) names it in ``torch_op``: the tracer then takes that node as
the custom op also where a program calls the ``torch.library`` op directly.

A process that has not registered an op library imports, the first time an op is not found,
the modules named in ``$POPTORCH_STANDIN_OP_LIBRARIES`` (comma-separated), which register
theirs: that is how a program's subprocesses get the op libraries its parent registered. They
load outside any trace, also when the first call comes from a model being traced.
"""
from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

__all__ = ["Numerics", "LIBRARIES_ENV", "register_op", "unregister_op", "find_op",
           "is_library_torch_op", "inside_custom_op", "running_custom_op"]

Numerics = Callable[[List[torch.Tensor], Dict[str, Any]], List[torch.Tensor]]

LIBRARIES_ENV = "POPTORCH_STANDIN_OP_LIBRARIES"

_ops: Dict[Tuple[str, str], Numerics] = {}
_torch_ops: Dict[Tuple[str, str], str] = {}  # (domain, name) -> "namespace::op"
_imported: Set[str] = set()
_depth = [0]


def register_op(domain: str, name: str, numerics: Numerics,
                torch_op: Optional[str] = None) -> None:
    """Make ``poptorch.custom_op(inputs, name, domain, ...)`` run ``numerics(inputs,
    attributes)``; ``torch_op`` ("namespace::op") is the ``torch.library`` op it runs, if any."""
    _ops[(domain, name)] = numerics
    if torch_op is not None:
        _torch_ops[(domain, name)] = torch_op
    else:
        _torch_ops.pop((domain, name), None)


def unregister_op(domain: str, name: str) -> None:
    """Forget ``domain::name`` (a later call is refused, as an op of an unloaded library)."""
    _ops.pop((domain, name), None)
    _torch_ops.pop((domain, name), None)


@contextlib.contextmanager
def _outside_any_trace() -> Iterator[None]:
    """No torch function or dispatch mode (the tracer's) sees what runs inside."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


def _import_named_libraries() -> None:
    # The first call may come while a model is traced: a library loads outside the trace, as
    # a real one is loaded (ctypes) before PopART sees the op.
    names = [name.strip() for name in os.environ.get(LIBRARIES_ENV, "").split(",")]
    if all(not name or name in _imported for name in names):
        return
    with _outside_any_trace():
        for module in names:
            if module and module not in _imported:
                _imported.add(module)
                importlib.import_module(module)


def find_op(domain: str, name: str) -> Optional[Numerics]:
    """The numerics registered for ``domain::name``, or None."""
    if (domain, name) not in _ops:
        _import_named_libraries()
    return _ops.get((domain, name))


def is_library_torch_op(qualified_name: str) -> bool:
    """Whether ``namespace::op`` is the ``torch.library`` op of a registered custom op."""
    if qualified_name not in _torch_ops.values():
        _import_named_libraries()
    return qualified_name in _torch_ops.values()


def inside_custom_op() -> bool:
    """Whether a custom op's numerics are running (the tracer does not check their ops)."""
    return _depth[0] > 0


@contextlib.contextmanager
def running_custom_op() -> Iterator[None]:
    _depth[0] += 1
    try:
        yield
    finally:
        _depth[0] -= 1

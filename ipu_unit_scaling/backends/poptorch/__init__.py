"""IPU backend: PopTorch options, pipelining and the training wrapper.

The same code runs against two ``poptorch`` modules, which the backend passes in
(:func:`poptorch_module`) rather than importing: the Poplar SDK's PopTorch for the ``ipu`` and
``ipu_model`` backends, and the project's PopTorch stand-in
(:mod:`ipu_unit_scaling.backends.poptorch_standin`) for ``emulator``, which runs PopTorch's
semantics on the CPU. Nothing is installed as ``poptorch`` in the process: the stand-in is only
an argument here. Nothing here imports poptorch at import time.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["STANDIN_MODULE", "poptorch_module", "is_standin", "poptorch_by_name"]

STANDIN_MODULE = "ipu_unit_scaling.backends.poptorch_standin"


def poptorch_module(backend: str) -> ModuleType:
    """The ``poptorch`` the IPU backend code runs against on ``backend``: the stand-in for
    ``emulator``, else ``import poptorch`` (the SDK's; ImportError where it is absent)."""
    if backend == "emulator":
        return importlib.import_module(STANDIN_MODULE)
    if backend in ("ipu", "ipu_model"):
        return importlib.import_module("poptorch")
    raise ValueError(f"backend {backend!r} does not run PopTorch")


def poptorch_by_name(name: str) -> ModuleType:
    """The module :func:`poptorch_module` gave, from its ``__name__`` (modules that PopTorch
    deep-copies keep the name, since a module object cannot be copied)."""
    return importlib.import_module(name)


def is_standin(poptorch: ModuleType) -> bool:
    """Whether ``poptorch`` is the stand-in (it runs the package's custom ops as their
    ``torch.library`` ops, so it needs no PopART library)."""
    return poptorch.__name__ == STANDIN_MODULE

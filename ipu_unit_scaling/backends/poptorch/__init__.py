"""IPU backend: PopTorch options, pipelining and the training wrapper.

The same code runs against two ``poptorch`` modules, which the backend passes in rather than
importing: the Poplar SDK's PopTorch for the ``ipu`` and ``ipu_model`` backends, and the
PopTorch stand-in (:mod:`ipu_standins.poptorch`) for ``emulator``, which runs PopTorch's
semantics on the CPU (:mod:`ipu_unit_scaling.backends.poptorch_backend` chooses). It uses only
PopTorch's public API, so the same code runs on both. Nothing is installed as ``poptorch`` in
the process, and nothing here imports poptorch at import time.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["poptorch_by_name"]


def poptorch_by_name(name: str) -> ModuleType:
    """The ``poptorch`` module the backend runs against, from its ``__name__`` (modules that
    PopTorch deep-copies keep the name, since a module object cannot be copied)."""
    return importlib.import_module(name)

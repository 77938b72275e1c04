"""``poptorch._poplar_executor``: where PopTorch defines :class:`PoplarExecutor` and its
compile hooks. Libraries built on PopTorch import them from here (Optimum Graphcore checks
``isinstance(model, poptorch._poplar_executor.PoplarExecutor)``); the stand-in defines them in
:mod:`._executor` and :mod:`._impl`, and this module gives them PopTorch's module path."""
from __future__ import annotations

from ._executor import NO_EXECUTABLE_ERR, PoplarExecutor
from ._impl import registerPostCompileHook, registerPreCompileHook

__all__ = ["PoplarExecutor", "NO_EXECUTABLE_ERR", "registerPreCompileHook",
           "registerPostCompileHook"]

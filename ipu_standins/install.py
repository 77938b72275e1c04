"""Make ``import poptorch`` (and ``import popxl``, ``import popart``) resolve to the stand-ins,
when asked.

:func:`install` puts a finder first on ``sys.meta_path`` that maps ``poptorch`` and
``poptorch.<sub>`` to :mod:`ipu_standins.poptorch` and its modules (one
module object each, so ``poptorch.Options is poptorch.options.Options``), ``popxl`` to the
project's PopXL stand-in and ``popart`` to :mod:`ipu_standins.popart`. It refuses, running
nothing, where the Poplar SDK's PopTorch (or PopXL, or PopART) can be imported: a stand-in never
shadows the real one. Being first on ``sys.meta_path``, the finder also wins over a
``poptorch.py`` in the program's own directory.

:data:`SHIM_DIRECTORY` holds a ``sitecustomize`` that installs the finder at start-up: with it
first on ``PYTHONPATH`` every interpreter a program starts serves the stand-ins too.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, List, Optional, Sequence

__all__ = ["install", "uninstall", "real_module_available", "StandInError", "STANDINS",
           "SHIM_DIRECTORY"]

SHIM_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_shim")

# name -> the module that stands in for it
STANDINS = {
    "poptorch": "ipu_standins.poptorch",
    "popxl": "ipu_standins.popxl",
    "popart": "ipu_standins.popart",
}


class StandInError(RuntimeError):
    """A stand-in was asked for where the real module imports."""


def real_module_available(name: str, path: Optional[Sequence[str]] = None) -> bool:
    """Whether ``name`` can be imported without the stand-in: from ``sys.path``, or from
    ``path`` where given (what another interpreter will search)."""
    for finder in sys.meta_path:
        if isinstance(finder, _StandInFinder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            if finder is importlib.machinery.PathFinder and path is not None:
                spec = importlib.machinery.PathFinder.find_spec(name, list(path))
            else:
                spec = find(name, None)
            if spec is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _resolve(name: str) -> Any:
    """The module ``name``, or a module-valued attribute of its parent (``popxl.ops``)."""
    try:
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    except ImportError:
        pass
    parent, _, attribute = name.rpartition(".")
    value = getattr(_resolve(parent), attribute, None) if parent else None
    return value if isinstance(value, types.ModuleType) else None


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return _resolve(self.target)

    def exec_module(self, module: Any) -> None:
        pass


class _StandInFinder(importlib.abc.MetaPathFinder):
    def __init__(self, names: Sequence[str]):
        self.names = tuple(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        top, _, rest = fullname.partition(".")
        if top not in self.names:
            return None
        base = STANDINS[top]
        module_name = f"{base}.{rest}" if rest else base
        if rest and _resolve(module_name) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(module_name),
                                              is_package=not rest)


def install(names: Sequence[str] = tuple(STANDINS)) -> List[str]:
    """Install the finder for ``names``; returns the names now served by a stand-in.

    Raises :class:`StandInError` if a real module of one of ``names`` imports."""
    uninstall()
    for name in names:
        if name not in STANDINS:
            raise ValueError(f"no stand-in for {name!r}; there are {sorted(STANDINS)}")
        if name in sys.modules and not _is_standin(sys.modules[name], name):
            raise StandInError(f"the real {name} is already imported; not replacing it")
        if real_module_available(name):
            raise StandInError(
                f"a real {name} is installed ({name} imports): run the program with it, "
                "not with the stand-in")
    sys.meta_path.insert(0, _StandInFinder(names))
    return list(names)


def _is_standin(module: Any, name: str) -> bool:
    return getattr(module, "__name__", "") == STANDINS[name] or (
        getattr(getattr(module, "__spec__", None), "loader", None).__class__ is _Loader)


def uninstall() -> None:
    """Remove the finder and forget the aliases it made."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StandInFinder)]
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top in STANDINS and name != STANDINS[top] and not name.startswith(
                STANDINS[top]) and _is_standin(sys.modules[name], top):
            del sys.modules[name]

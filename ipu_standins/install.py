"""Make ``import poptorch`` (and ``import popxl``) resolve to the stand-ins, when asked.

:func:`install` puts a finder first on ``sys.meta_path`` that maps ``poptorch`` and
``poptorch.<sub>`` to :mod:`ipu_standins.poptorch` and its modules (one
module object each, so ``poptorch.Options is poptorch.options.Options``), and ``popxl`` to the
project's PopXL stand-in. It refuses, running nothing, where the Poplar SDK's PopTorch (or
PopXL) can be imported: a stand-in never shadows the real one.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
import types
from typing import Any, List, Optional, Sequence

__all__ = ["install", "uninstall", "real_module_available", "StandInError", "STANDINS",
           "SHIM_ENV", "shim_directory"]

# A directory with a ``poptorch`` and a ``popxl`` package that serve the stand-ins: put on
# PYTHONPATH by ``emulate`` so that the program's own subprocesses import them too.
SHIM_ENV = "IPU_UNIT_SCALING_STANDIN_SHIM"
# The shim finds ipu_standins where this process found it (appended: it shadows nothing).
_SHIM_CODE = ("import sys\n"
              "if {root!r} not in sys.path:\n"
              "    sys.path.append({root!r})\n"
              "from ipu_standins.install import serve_from_shim\n"
              "serve_from_shim(__name__)\n")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> the module that stands in for it
STANDINS = {
    "poptorch": "ipu_standins.poptorch",
    "popxl": "ipu_standins.popxl",
}


class StandInError(RuntimeError):
    """A stand-in was asked for where the real module imports."""


def _is_shim(spec: Any) -> bool:
    shim = os.environ.get(SHIM_ENV) or ""
    origin = getattr(spec, "origin", None) or ""
    return bool(shim) and os.path.abspath(origin).startswith(os.path.abspath(shim) + os.sep)


def shim_directory() -> str:
    """The shim directory of this process (made on first use, in the temporary directory)."""
    existing = os.environ.get(SHIM_ENV)
    if existing and os.path.isdir(existing):
        return existing
    directory = tempfile.mkdtemp(prefix="ipu-unit-scaling-standins-")
    for name in STANDINS:
        os.makedirs(os.path.join(directory, name))
        with open(os.path.join(directory, name, "__init__.py"), "w") as handle:
            handle.write(_SHIM_CODE.format(root=_ROOT))
    os.environ[SHIM_ENV] = directory
    return directory


def serve_from_shim(name: str) -> None:
    """Run by a shim package: install the stand-ins and become the stand-in module."""
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        install(tuple(STANDINS))
    sys.modules[name] = importlib.import_module(STANDINS[name])


def real_module_available(name: str) -> bool:
    """Whether ``name`` can be imported from ``sys.path`` without the stand-in."""
    for finder in sys.meta_path:
        if isinstance(finder, _StandInFinder):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, None)
            if spec is not None and not _is_shim(spec):
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


def install(names: Sequence[str] = ("poptorch", "popxl")) -> List[str]:
    """Install the finder for ``names``; returns the names now served by a stand-in.

    Raises :class:`StandInError` if a real module of one of ``names`` imports."""
    uninstall()
    for name in names:
        if name not in STANDINS:
            raise ValueError(f"no stand-in for {name!r}; there are {sorted(STANDINS)}")
        if name in sys.modules and not _is_standin(sys.modules[name], name) and not _is_shim(
                getattr(sys.modules[name], "__spec__", None)):
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

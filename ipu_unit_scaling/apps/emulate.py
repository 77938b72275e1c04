"""``ipu-unit-scaling emulate``: run an unchanged PopTorch (or PopXL) program on the CPU.

``emulate SCRIPT [ARGS...]`` runs a script as ``python SCRIPT ARGS...`` would, and
``emulate -m MODULE [ARGS...]`` as ``python -m MODULE ARGS...`` (``emulate -m pytest tests/``
runs a PopTorch test suite), with ``import poptorch`` resolved to the package's PopTorch
stand-in and ``import popxl`` to its PopXL stand-in
(:mod:`ipu_standins.install`). Where the Poplar SDK's PopTorch
or PopXL imports, it says so in one line and runs nothing: a stand-in never shadows the real
module. The exit status is the program's.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from typing import List, Optional, Sequence

__all__ = ["run_emulated", "USAGE", "STANDIN_OP_LIBRARY"]

# The module that registers the package's custom ops with the PopTorch stand-in, by name: the
# stand-in imports it when a program first asks for one of them.
STANDIN_OP_LIBRARY = "ipu_unit_scaling.backends.standin_op_library"

USAGE = ("usage: ipu-unit-scaling emulate SCRIPT [ARGS...] | "
         "ipu-unit-scaling emulate -m MODULE [ARGS...]")


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _find_the_standins() -> None:
    """ipu_standins ships beside ipu_unit_scaling, in the same directory; an editable install
    made before the stand-ins had a package of their own does not map it yet."""
    if importlib.util.find_spec("ipu_standins") is None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
        if os.path.isdir(os.path.join(root, "ipu_standins")):
            sys.path.append(root)


def run_emulated(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``argv`` (what follows ``emulate``); returns the program's exit status."""
    _find_the_standins()
    from ipu_standins.install import StandInError, install, shim_directory
    from ipu_standins.poptorch_custom_ops import LIBRARIES_ENV

    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\nRuns a PopTorch program with `import poptorch` (and `import popxl`) "
              "resolved to the package's stand-ins.", file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    module: Optional[str] = None
    if args[0] == "-m":
        if len(args) < 2:
            print(f"ipu-unit-scaling emulate: -m needs a module name ({USAGE})", file=sys.stderr)
            return 2
        module, rest = args[1], args[2:]
    else:
        script, rest = args[0], args[1:]
        if not os.path.exists(script):
            print(f"ipu-unit-scaling emulate: {script}: no such file", file=sys.stderr)
            return 2
    try:
        install(("poptorch", "popxl"))
    except StandInError as error:
        print(f"ipu-unit-scaling emulate: {error}", file=sys.stderr)
        return 2
    # The program's subprocesses (python -c "import poptorch", spawned workers) import the
    # stand-ins through a shim package on PYTHONPATH.
    shim = shim_directory()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (shim, os.environ.get("PYTHONPATH")) if p)
    # The package's PopART custom ops run on the stand-in, here and in those subprocesses,
    # loaded when a program first calls one (poptorch.custom_op): nothing of the package
    # loads before.
    os.environ[LIBRARIES_ENV] = ",".join(
        p for p in (os.environ.get(LIBRARIES_ENV), STANDIN_OP_LIBRARY) if p)
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    try:
        if module is not None:
            sys.argv = [module, *rest]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *rest]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        return _exit_code(stop)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


if __name__ == "__main__":
    sys.exit(run_emulated())

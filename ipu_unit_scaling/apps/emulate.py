"""``ipu-unit-scaling emulate``: run an unchanged PopTorch (or PopXL) program on the CPU.

``emulate SCRIPT [ARGS...]`` is ``python SCRIPT ARGS...`` and ``emulate -m MODULE [ARGS...]`` is
``python -m MODULE ARGS...`` (``emulate -m pytest tests/`` runs a PopTorch test suite), with
``import poptorch``, ``import popxl`` and ``import popart`` resolved to the stand-ins
(:mod:`ipu_standins.install`), and the PopTorch stand-in reporting an emulated IPU system
(:mod:`ipu_standins.emulated_system`; ``--ipus N`` in front of the program, or
``IPU_UNIT_SCALING_EMULATED_IPUS``, sets its IPUs, 16 without either, 0 for none), said once
on standard error. The command replaces itself with that very ``python`` command
(``exec``), the stand-ins' start-up directory (:data:`ipu_standins.install.SHIM_DIRECTORY`) first
on ``PYTHONPATH``: so the program's exit status, its tracebacks, ``Ctrl-C``, ``__file__``,
``sys.argv`` and ``sys.path`` are Python's own, every interpreter the program starts (spawned and
forkserver workers, ``python -c``) serves the stand-ins too, and nothing of the command's is
left behind (torch's fake-tensor mode, which the stand-in traces with, makes torch's compile
cache directory, ``$TMPDIR/torchinductor_<user>``, as ``torch.compile`` does).

Where the Poplar SDK's PopTorch (or PopXL, or PopART) imports, it says so in one line and runs
nothing: a stand-in never shadows the real module. A ``poptorch.py`` (or ``popxl``, ``popart``)
beside the program is not what ``import poptorch`` gives: a note on standard error says so.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["run_emulated", "USAGE", "STANDIN_OP_LIBRARY", "OP_LIBRARIES_ENV"]

# The module that registers the package's custom ops with the PopTorch stand-in, by name: the
# stand-in imports it when a program first asks for one of them.
STANDIN_OP_LIBRARY = "ipu_unit_scaling.backends.standin_op_library"
# ipu_standins.poptorch_custom_ops.LIBRARIES_ENV, spelled out: importing that module loads torch,
# seconds that only the program should spend (a test holds the two equal).
OP_LIBRARIES_ENV = "POPTORCH_STANDIN_OP_LIBRARIES"

USAGE = ("usage: ipu-unit-scaling emulate [--ipus N] SCRIPT [ARGS...] | "
         "ipu-unit-scaling emulate [--ipus N] -m MODULE [ARGS...]")
PREFIX = "ipu-unit-scaling emulate"
# The interpreter flags that would stop the program's interpreter reading PYTHONPATH or
# running site (and with it the stand-ins' start-up).
_FLAGS_THAT_HIDE_THE_STANDINS = ("-E", "-I", "-S")


def _find_the_standins() -> None:
    """ipu_standins ships beside ipu_unit_scaling, in the same directory; an editable install
    made before the stand-ins had a package of their own does not map it yet."""
    if importlib.util.find_spec("ipu_standins") is None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
        if os.path.isdir(os.path.join(root, "ipu_standins")):
            sys.path.append(root)


def _program_directory(module: Optional[str], script: Optional[str]) -> Optional[str]:
    """The directory Python puts first on the program's ``sys.path``."""
    if getattr(sys.flags, "safe_path", False):
        return None
    if module is not None:
        return os.getcwd()
    assert script is not None
    return os.path.dirname(os.path.realpath(script))


def _note_what_is_not_used(directory: Optional[str], names: Sequence[str]) -> None:
    if directory is None:
        return
    found = [(name, shown) for name in names
             for shown, exists in ((name + ".py", os.path.isfile), (name + os.sep, os.path.isdir))
             if exists(os.path.join(directory, shown))]
    if found:
        print(f"{PREFIX}: note: {', '.join(shown for _, shown in found)} in {directory} "
              f"not used: {', '.join(sorted({'import ' + name for name, _ in found}))} "
              "gives the stand-in (ipu_standins)", file=sys.stderr)


def _interpreter_flags() -> List[str]:
    flags: List[str] = getattr(subprocess, "_args_from_interpreter_flags", lambda: [])()
    return [flag for flag in flags if flag not in _FLAGS_THAT_HIDE_THE_STANDINS]


def _split_ipus_option(args: List[str]) -> Tuple[Optional[str], List[str]]:
    """``--ipus N`` (or ``--ipus=N``) in front of the program, and what follows it."""
    if args and args[0].startswith("--ipus="):
        return args[0][len("--ipus="):], args[1:]
    if args and args[0] == "--ipus":
        if len(args) < 2:
            raise ValueError("--ipus needs a number of IPUs")
        return args[1], args[2:]
    return None, args


def _emulated_ipus(option: Optional[str], environment: Dict[str, str]) -> int:
    """The emulated system's IPUs: ``--ipus``, else the environment's, else the default."""
    from ipu_standins.emulated_system import (
        DEFAULT_EMULATED_IPUS,
        EMULATED_IPUS_ENV,
        parse_ipu_count,
    )

    if option is not None:
        return parse_ipu_count(option, "--ipus")
    text = environment.get(EMULATED_IPUS_ENV, "")
    return parse_ipu_count(text) if text.strip() else DEFAULT_EMULATED_IPUS


def run_emulated(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``argv`` (what follows ``emulate``). On POSIX this process becomes the program and
    never returns; it returns 2 on a usage error or where a real SDK module imports (and the
    program's exit status where ``exec`` is not available)."""
    args: List[str] = list(sys.argv[1:] if argv is None else argv)
    try:
        ipus_option, args = _split_ipus_option(args)
    except ValueError as error:
        print(f"{PREFIX}: {error}", file=sys.stderr)
        return 2
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\nRuns a PopTorch program as python would, with `import poptorch` "
              "(`import popxl`, `import popart`) resolved to the package's stand-ins, on an "
              "emulated IPU system: --ipus N (or IPU_UNIT_SCALING_EMULATED_IPUS) sets its "
              "number of IPUs (16 without either; 0: no IPU system).",
              file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    module: Optional[str] = None
    script: Optional[str] = None
    if args[0] == "-m":
        if len(args) < 2:
            print(f"{PREFIX}: -m needs a module name ({USAGE})", file=sys.stderr)
            return 2
        module = args[1]
    else:
        script = args[0]
    _find_the_standins()
    from ipu_standins.emulated_system import EMULATED_IPUS_ENV, describe
    from ipu_standins.install import SHIM_DIRECTORY, STANDINS, real_module_available

    try:
        ipus = _emulated_ipus(ipus_option, dict(os.environ))
    except ValueError as error:
        print(f"{PREFIX}: {error}", file=sys.stderr)
        return 2

    # What the program's interpreter will search, less the directory Python puts first.
    path = sys.path[1:] if sys.path and not getattr(sys.flags, "safe_path", False) else sys.path
    for name in STANDINS:
        if real_module_available(name, path):
            print(f"{PREFIX}: a real {name} is installed ({name} imports): run the program "
                  "with it, not with the stand-in", file=sys.stderr)
            return 2
    _note_what_is_not_used(_program_directory(module, script), list(STANDINS))

    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(
        p for p in (SHIM_DIRECTORY, os.environ.get("PYTHONPATH")) if p)
    # The package's PopART custom ops run on the stand-in, loaded when a program first calls
    # one (poptorch.custom_op): nothing of the package loads before.
    environment[OP_LIBRARIES_ENV] = ",".join(
        p for p in (os.environ.get(OP_LIBRARIES_ENV), STANDIN_OP_LIBRARY) if p)
    environment[EMULATED_IPUS_ENV] = str(ipus)
    if ipus:
        print(f"{PREFIX}: emulating {describe(ipus)}: poptorch.ipuHardwareIsAvailable() is "
              "True; --ipus N or IPU_UNIT_SCALING_EMULATED_IPUS=N sets the number, 0 for none",
              file=sys.stderr)
    command = [sys.executable, *_interpreter_flags(), *args]
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name != "posix":
        return subprocess.call(command, env=environment)
    # Ctrl-C as Python finds it at start-up (unless the shell had it ignored): the program's
    # interpreter installs its own KeyboardInterrupt handler over it.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execve(sys.executable, command, environment)
    return 1  # not reached: execve returns only by raising


if __name__ == "__main__":
    sys.exit(run_emulated())

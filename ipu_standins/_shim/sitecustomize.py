"""Run by Python's ``site`` at start-up where this directory is on ``PYTHONPATH`` (which is how
``ipu-unit-scaling emulate`` starts a program): makes ``import poptorch``, ``import popxl`` and
``import popart`` resolve to the stand-ins, then runs the ``sitecustomize`` this one hides, if
the environment has one. It imports only :mod:`ipu_standins.install` (no torch): an interpreter
that never imports a stand-in pays a few path look-ups."""
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _same_directory(entry: str) -> bool:
    try:
        return os.path.samefile(entry or os.curdir, _HERE)
    except OSError:
        return False


def _serve_the_standins() -> None:
    if importlib.util.find_spec("ipu_standins") is None:
        # ipu_standins sits two levels up; appended, it shadows nothing the program imports.
        sys.path.append(os.path.dirname(os.path.dirname(_HERE)))
    from ipu_standins.install import STANDINS, StandInError, install

    try:
        install(tuple(STANDINS))
    except StandInError:
        pass  # a real SDK is importable here: the program gets it, never a stand-in


def _run_the_hidden_sitecustomize() -> None:
    this = sys.modules.pop(__name__)
    try:
        import sitecustomize  # noqa: F401  (the environment's own, found past this directory)
    except ImportError as error:
        if error.name != "sitecustomize":
            raise
        sys.modules[__name__] = this  # site's import of this module expects to find it there


# The program sees sys.path as Python makes it: this directory stays only on PYTHONPATH, for the
# interpreters the program starts.
sys.path[:] = [entry for entry in sys.path if not _same_directory(entry)]
_serve_the_standins()
if __name__ == "sitecustomize":
    _run_the_hidden_sitecustomize()

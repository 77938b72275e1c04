"""``poptorch._poplar_executor``, the module where PopTorch defines ``PoplarExecutor``: libraries
built on PopTorch import it by that path (Optimum Graphcore's pipelines check
``isinstance(model, poptorch._poplar_executor.PoplarExecutor)`` after ``import poptorch``)."""
from __future__ import annotations

import subprocess
import sys

import torch

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch import _poplar_executor


def test_the_executor_and_the_compile_hooks_are_poptorch_s_own_objects():
    assert _poplar_executor.PoplarExecutor is poptorch.PoplarExecutor
    assert _poplar_executor.registerPreCompileHook is poptorch.registerPreCompileHook
    assert _poplar_executor.registerPostCompileHook is poptorch.registerPostCompileHook
    assert _poplar_executor.NO_EXECUTABLE_ERR == (
        "Model has not been compiled or has been destroyed.")
    model = poptorch.inferenceModel(torch.nn.Linear(2, 2))
    assert isinstance(model, poptorch._poplar_executor.PoplarExecutor)


def test_import_poptorch_gives_the_module_by_its_path():
    """Through the stand-in's import finder, in a fresh interpreter: the attribute after a
    plain ``import poptorch``, and ``from poptorch._poplar_executor import ...``."""
    code = ("from ipu_standins.install import install; install()\n"
            "import poptorch\n"
            "from poptorch._poplar_executor import PoplarExecutor\n"
            "print(poptorch._poplar_executor.PoplarExecutor is PoplarExecutor "
            "is poptorch.PoplarExecutor)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr

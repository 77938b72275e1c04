"""The stand-ins' start-up directory (``SHIM_DIRECTORY``, first on ``PYTHONPATH`` under
``ipu-unit-scaling emulate``): a fresh interpreter serves the stand-ins, keeps ``sys.path`` as
Python makes it, still runs the environment's own ``sitecustomize``, and leaves a real SDK
module alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

from helpers import ROOT

from ipu_standins.install import SHIM_DIRECTORY

SHOW = ("import json, sys; import poptorch, popxl, popart; print(json.dumps("
        "[poptorch.__name__, popxl.__name__, popart.__name__, sys.path]))")


def _run(python_path: List[str], code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(python_path)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300)


def test_the_shim_lives_in_the_package():
    assert Path(SHIM_DIRECTORY, "sitecustomize.py").is_file()
    assert Path(SHIM_DIRECTORY).parent == ROOT / "ipu_standins"


def test_a_fresh_interpreter_serves_the_standins_with_pythons_sys_path(tmp_path):
    done = _run([SHIM_DIRECTORY, str(ROOT)], SHOW, tmp_path)
    assert done.returncode == 0, done.stderr
    names, path = json.loads(done.stdout)[:3], json.loads(done.stdout)[3]
    assert names == ["ipu_standins.poptorch", "ipu_standins.popxl", "ipu_standins.popart"]
    plain = _run([str(ROOT)], "import json, sys; print(json.dumps(sys.path))", tmp_path)
    assert path == json.loads(plain.stdout)


def test_the_environments_own_sitecustomize_still_runs(tmp_path):
    own = tmp_path / "site"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import builtins\nbuiltins.OWN_SITE_RAN = True\n")
    done = _run([SHIM_DIRECTORY, str(ROOT), str(own)],
                "import poptorch, sitecustomize; print(OWN_SITE_RAN, poptorch.__name__, "
                "sitecustomize.__file__)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "ipu_standins.poptorch",
                                   str(own / "sitecustomize.py")]


def test_a_real_sdk_module_is_left_alone(tmp_path):
    sdk = tmp_path / "sdk" / "poptorch"
    sdk.mkdir(parents=True)
    (sdk / "__init__.py").write_text("REAL = True\n")
    done = _run([SHIM_DIRECTORY, str(ROOT), str(tmp_path / "sdk")],
                "import poptorch; print(poptorch.REAL)", tmp_path)
    assert (done.returncode, done.stdout) == (0, "True\n"), done.stderr

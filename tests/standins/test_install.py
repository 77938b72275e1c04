"""The stand-ins are leaves: they import torch and nothing of ipu_unit_scaling, so a program's
``import poptorch`` (or ``import popxl``) under ``ipu-unit-scaling emulate`` loads no module of
the package."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ROOT

import ipu_standins

STANDINS = Path(ipu_standins.__file__).parent


def _imported_tops(path: Path) -> set:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_no_module_of_the_standins_imports_the_package():
    importing = sorted(str(p.relative_to(STANDINS)) for p in STANDINS.rglob("*.py")
                       if "ipu_unit_scaling" in _imported_tops(p))
    assert not importing, f"stand-in modules that import ipu_unit_scaling: {importing}"


# Run under `ipu-unit-scaling emulate`: the package modules `import poptorch` / `import popxl`
# load in this process, and those a fresh interpreter (through emulate's shim) holds after them.
PROGRAM = textwrap.dedent("""
    import json, subprocess, sys
    def ours(names):
        return sorted(m for m in names if m.split(".")[0] == "ipu_unit_scaling")
    found = {}
    for name in ("poptorch", "popxl"):
        before = set(sys.modules)
        __import__(name)
        found["here " + name] = ours(set(sys.modules) - before)
        code = ("import sys, json; import " + name + "; print(json.dumps(sorted(m for m in "
                "sys.modules if m.split('.')[0] == 'ipu_unit_scaling')))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        found["fresh " + name] = json.loads(done.stdout) if done.returncode == 0 else [
            "failed: " + done.stderr[-300:]]
        found["fresh " + name + " module"] = subprocess.run(
            [sys.executable, "-c", "import " + name + "; print(" + name + ".__name__)"],
            capture_output=True, text=True).stdout.strip()
    print(json.dumps(found))
""")


def test_import_poptorch_under_emulate_loads_nothing_of_the_package(tmp_path):
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    done = subprocess.run([sys.executable, "-m", "ipu_unit_scaling", "emulate", str(program)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "here poptorch": [], "fresh poptorch": [], "fresh poptorch module": "ipu_standins.poptorch",
        "here popxl": [], "fresh popxl": [], "fresh popxl module": "ipu_standins.popxl",
    }

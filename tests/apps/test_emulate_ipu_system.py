"""``ipu-unit-scaling emulate`` presents an emulated IPU system: an IPU-POD16 of Mk2 IPUs by
default, ``--ipus N`` or ``IPU_UNIT_SCALING_EMULATED_IPUS`` for another size (0 for none), said
once on standard error, seen by the interpreters the program starts, and a count no IPU system
has refused in one line before the program runs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from helpers import ROOT

ENV = "IPU_UNIT_SCALING_EMULATED_IPUS"
PROGRAM = """
    import subprocess, sys
    import poptorch
    sizes = (1, 2, 3, 4, 8, 16, 32, 64)
    print("available", [n for n in sizes if poptorch.ipuHardwareIsAvailable(n)])
    print("version", poptorch.ipuHardwareVersion() if poptorch.ipuHardwareIsAvailable() else 0)
    child = "import poptorch; print('child', poptorch.ipuHardwareIsAvailable(4))"
    subprocess.run([sys.executable, "-c", child], check=True)
"""


def _emulate(args: List[str], cwd: Path, ipus_env: Optional[str] = None
             ) -> subprocess.CompletedProcess:
    env: Dict[str, str] = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env.pop(ENV, None)
    if ipus_env is not None:
        env[ENV] = ipus_env
    return subprocess.run([sys.executable, "-m", "ipu_unit_scaling", "emulate", *args],
                          cwd=cwd, env=env, text=True, capture_output=True, timeout=600)


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "system.py"
    path.write_text(textwrap.dedent(PROGRAM))
    return path


def test_an_ipu_pod16_by_default_said_once(program):
    done = _emulate([str(program)], program.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "available [1, 2, 4, 8, 16]", "version 2", "child True"]
    # Once, from emulate, though two interpreters import poptorch.
    assert done.stderr.splitlines() == [
        "ipu-unit-scaling emulate: emulating an IPU-POD16 (16 Mk2 IPUs): "
        "poptorch.ipuHardwareIsAvailable() is True; --ipus N or "
        "IPU_UNIT_SCALING_EMULATED_IPUS=N sets the number, 0 for none"]


@pytest.mark.parametrize("args, ipus_env, available, said", [
    (["--ipus", "64"], None, "[1, 2, 4, 8, 16, 32, 64]", "an IPU-POD64 (64 Mk2 IPUs)"),
    (["--ipus=2"], "64", "[1, 2]", "a system of 2 Mk2 IPUs"),  # the flag wins
    ([], "4", "[1, 2, 4]", "an IPU-POD4 (4 Mk2 IPUs)"),
])
def test_the_flag_and_the_variable_set_the_number(program, args, ipus_env, available, said):
    done = _emulate(args + [str(program)], program.parent, ipus_env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"available {available}"
    assert f"emulating {said}:" in done.stderr


def test_none_with_zero_and_nothing_said(program):
    done = _emulate(["--ipus", "0", "-m", "system"], program.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["available []", "version 0", "child False"]
    assert done.stderr == ""


@pytest.mark.parametrize("args, ipus_env, source, text", [
    (["--ipus", "3"], None, "--ipus", "'3'"),
    (["--ipus=many"], None, "--ipus", "'many'"),
    ([], "12", ENV, "'12'"),
    ([], "2048", ENV, "'2048'"),
])
def test_a_count_no_ipu_system_has_is_refused_in_one_line(program, args, ipus_env, source,
                                                          text):
    done = _emulate(args + [str(program)], program.parent, ipus_env)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"ipu-unit-scaling emulate: {source} must be 0 (no IPU system) or a power of two "
        f"from 1 to 1024, not {text}"]


def test_ipus_without_a_number_is_a_usage_error(tmp_path):
    done = _emulate(["--ipus"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["ipu-unit-scaling emulate: --ipus needs a number of IPUs"]

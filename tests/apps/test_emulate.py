"""``ipu-unit-scaling emulate``: unchanged PopTorch programs (examples/poptorch, in the style of
Graphcore's tutorials), ``-m MODULE`` with Python's argv, ``-m pytest``, and the refusal to
shadow a real PopTorch."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import List

import pytest
from helpers import ROOT

EXAMPLES = ROOT / "examples" / "poptorch"


def _emulate(args: List[str], cwd: Path = ROOT, env_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env_path, str(ROOT)) if p)
    return subprocess.run([sys.executable, "-m", "ipu_unit_scaling.apps.cli", "emulate", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _losses(output: str) -> List[float]:
    return [float(v) for v in re.findall(r"epoch \d+ loss: ([0-9.]+)", output)]


def _value(output: str, key: str) -> str:
    match = re.search(rf"^{key}: (.*)$", output, re.M)
    assert match, output
    return match.group(1)


def test_basics_tutorial_style_program():
    done = _emulate([str(EXAMPLES / "basics.py")])
    assert done.returncode == 0, done.stderr
    losses = _losses(done.stdout)
    assert len(losses) == 3 and losses[-1] < losses[0]
    # Training returns OutputMode.Final: the last micro-batch's logits and a scalar loss;
    # inference returns All: every micro-batch of the 4 device iterations.
    assert _value(done.stdout, "combined batch") == "64"
    assert _value(done.stdout, "training logits shape") == "(16, 4)"
    assert _value(done.stdout, "training loss shape") == "()"
    assert _value(done.stdout, "inference logits shape") == "(64, 4)"


def test_pipelining_tutorial_style_program():
    done = _emulate([str(EXAMPLES / "pipelining.py"), "--gradient-accumulation", "4"])
    assert done.returncode == 0, done.stderr
    losses = _losses(done.stdout)
    assert losses[-1] < losses[0]
    # OutputMode.All with gradientAccumulation 4: 4 micro-batches of 8 rows, 4 losses.
    assert _value(done.stdout, "output shape") == "(32, 1)"
    assert _value(done.stdout, "loss shape") == "(4,)"
    refused = _emulate([str(EXAMPLES / "pipelining.py"), "--gradient-accumulation", "2"])
    assert refused.returncode != 0
    assert "number of pipeline stages (3)" in refused.stderr


def test_mixed_precision_tutorial_style_program():
    done = _emulate([str(EXAMPLES / "mixed_precision.py")])
    assert done.returncode == 0, done.stderr
    losses = _losses(done.stdout)
    assert losses[-1] < losses[0]
    assert _value(done.stdout, "logits dtype") == "torch.float16"
    assert _value(done.stdout, "finite weights") == "True"


def test_module_runs_as_python_m(tmp_path):
    (tmp_path / "prog.py").write_text(textwrap.dedent("""
        import sys
        import poptorch
        import poptorch.optim
        print("argv", sys.argv[1:], sys.argv[0].endswith("prog.py"))
        print("module", poptorch.__name__, poptorch.optim.__name__)
        print("hardware", poptorch.ipuHardwareIsAvailable())
        sys.exit(3)
    """))
    done = _emulate(["-m", "prog", "a", "--b"], cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert "argv ['a', '--b'] True" in done.stdout
    assert "module ipu_standins.poptorch " in done.stdout
    assert "hardware True" in done.stdout  # the emulated IPU-POD16


def test_pytest_runs_a_poptorch_test_file(tmp_path):
    (tmp_path / "test_small.py").write_text(textwrap.dedent("""
        import torch
        import poptorch

        def test_inference_matches_torch():
            model = torch.nn.Linear(3, 2)
            out = poptorch.inferenceModel(model)(torch.ones(2, 3))
            assert torch.allclose(out, model(torch.ones(2, 3)))

        def test_fails_on_purpose():
            assert not poptorch.ipuHardwareIsAvailable()  # emulate presents an IPU system
    """))
    done = _emulate(["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_small.py"],
                    cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout


def test_refuses_to_shadow_a_real_poptorch(tmp_path):
    real = tmp_path / "sdk" / "poptorch"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("raise SystemExit('the real one must not run')\n")
    script = tmp_path / "prog.py"
    script.write_text("print('ran')\n")
    done = _emulate([str(script)], env_path=str(tmp_path / "sdk"))
    assert done.returncode == 2
    assert "ran" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "real poptorch" in lines[0]


@pytest.mark.parametrize("args", [[], ["-m"]])
def test_usage_errors(args, capsys):
    from ipu_unit_scaling.apps.emulate import run_emulated

    assert run_emulated(args) == 2
    assert "emulate" in capsys.readouterr().err


def test_install_serves_both_standins_in_process():
    import importlib

    from ipu_standins import install

    install.install(("poptorch", "popxl"))
    try:
        poptorch = importlib.import_module("poptorch")
        options = importlib.import_module("poptorch.options")
        popxl_ops = importlib.import_module("popxl.ops")
        assert poptorch.Options is options.Options
        assert poptorch.__name__ == "ipu_standins.poptorch"
        assert popxl_ops.__name__ == "ipu_standins.popxl._ops"
    finally:
        install.uninstall()
    with pytest.raises(ImportError):
        importlib.import_module("poptorch")


def test_the_op_library_emulate_names_is_the_one_that_registers_the_custom_ops():
    from ipu_unit_scaling.apps.emulate import STANDIN_OP_LIBRARY
    from ipu_unit_scaling.backends import standin_op_library

    assert STANDIN_OP_LIBRARY == standin_op_library.LIBRARY_MODULE


def test_a_program_under_emulate_calls_the_packages_custom_ops(tmp_path):
    """``poptorch.custom_op`` of the package's ops: their numerics load when first asked for,
    in the program's process and in its subprocesses."""
    (tmp_path / "prog.py").write_text(textwrap.dedent("""
        import subprocess, sys
        import torch
        import poptorch
        code = ("import torch, poptorch; print(poptorch.custom_op([torch.tensor([3.0])], "
                "'ScaledIdentity', 'ai.graphcore.unit_scaling', 1, [], "
                "{'fwd_scale': 2.0, 'bwd_scale': 1.0})[0].tolist())")
        exec(code)
        print(subprocess.run([sys.executable, "-c", code], capture_output=True,
                             text=True).stdout.strip())
    """))
    done = _emulate([str(tmp_path / "prog.py")])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[6.0]", "[6.0]"]

"""``ipu-unit-scaling emulate PROGRAM`` behaves as ``python PROGRAM`` for all that is not
PopTorch: exit statuses, Ctrl-C, tracebacks, errors before the program runs, ``__file__``,
``sys.argv``, ``sys.path``, spawned workers, and no files left behind. Each program runs in a
subprocess, as a user runs it, and is compared with what ``python`` itself does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

from helpers import ROOT, as_a_foreground_job


def _environment(tmp: Optional[Path] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    # No emulated IPU system, so no line of emulate's own on stderr before the program's
    # (test_emulate_ipu_system.py checks that line, and that the rest is the program's).
    env["IPU_UNIT_SCALING_EMULATED_IPUS"] = "0"
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


def _python(args: List[str], cwd: Path, poptorch: Optional[Path] = None
            ) -> subprocess.CompletedProcess:
    """``python ARGS``; ``poptorch``: a directory to find an (empty) ``poptorch`` module in."""
    env = _environment()
    if poptorch is not None:
        poptorch.mkdir(exist_ok=True)
        (poptorch / "poptorch.py").write_text("")
        env["PYTHONPATH"] += os.pathsep + str(poptorch)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=600)


def _emulate(args: List[str], cwd: Path, tmp: Optional[Path] = None
             ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ipu_unit_scaling", "emulate", *args],
                          cwd=cwd, env=_environment(tmp), text=True, capture_output=True,
                          timeout=600)


def _write(path: Path, code: str) -> Path:
    path.write_text(textwrap.dedent(code))
    return path


def test_exit_status_and_traceback_are_pythons(tmp_path):
    _write(tmp_path / "exits.py", "import sys, poptorch\nsys.exit(int(sys.argv[1]))\n")
    for status in ("0", "3", "255"):
        assert _emulate(["exits.py", status], tmp_path).returncode == int(status)
    # An uncaught exception: status 1 and the traceback Python prints, from the program's
    # first frame (no frame of the command before it).
    _write(tmp_path / "raises.py", """
        import poptorch

        def check(value):
            raise ValueError(f"bad value {value}")

        check(3)
    """)
    python = _python(["raises.py"], tmp_path, poptorch=tmp_path / "empty")
    emulated = _emulate(["raises.py"], tmp_path)
    assert emulated.returncode == python.returncode == 1
    assert emulated.stderr == python.stderr
    assert emulated.stderr.splitlines()[1].startswith(f'  File "{tmp_path / "raises.py"}"')


def test_errors_before_the_program_runs_are_pythons(tmp_path):
    _write(tmp_path / "bad_syntax.py", "import poptorch\nx = (1,\n")
    for args in (["-m", "no_such_module"], ["bad_syntax.py"], ["no_such_script.py"]):
        python = _python(args, tmp_path, poptorch=tmp_path / "empty")
        emulated = _emulate(args, tmp_path)
        assert (emulated.returncode, emulated.stderr) == (python.returncode, python.stderr), args
        assert emulated.returncode in (1, 2) and "emulate" not in emulated.stderr
    assert len(_emulate(["-m", "no_such_module"], tmp_path).stderr.splitlines()) == 1


def test_file_argv_and_path_are_pythons(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    code = """
        import json, sys
        print(json.dumps({"file": __file__, "argv": sys.argv, "path": sys.path,
                          "main": __name__, "spec": getattr(__spec__, "name", None)}))
    """
    _write(tmp_path / "pkg" / "show.py", code)
    for args in (["pkg/show.py", "a", "--b"], ["-m", "pkg.show", "a", "--b"]):
        python, emulated = _python(args, tmp_path), _emulate(args, tmp_path)
        assert emulated.returncode == 0, emulated.stderr
        assert emulated.stdout == python.stdout, args
    assert os.path.isabs(_emulate(["pkg/show.py"], tmp_path).stdout.split('"')[3])


def test_ctrl_c_in_a_training_loop_ends_as_pythons_keyboard_interrupt(tmp_path):
    """Python ends on an uncaught KeyboardInterrupt by SIGINT itself (status 130 in a shell),
    after its traceback; the emulated program ends the same way."""
    program = _write(tmp_path / "train.py", """
        import torch
        import poptorch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 2)

            def forward(self, x, y):
                out = self.linear(x)
                return out, torch.nn.functional.mse_loss(out, y)

        model = Net()
        training = poptorch.trainingModel(
            model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.01))
        x, y = torch.ones(8, 4), torch.zeros(8, 2)
        for step in range(10**9):
            training(x, y)
            if step == 2:
                print("training", flush=True)
    """)
    command = [sys.executable, "-m", "ipu_unit_scaling", "emulate", str(program)]
    process = subprocess.Popen(command, env=_environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=as_a_foreground_job)
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == "training\n"
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:  # (a loop that never ends is not left running)
            process.kill()
            process.communicate()
    python = subprocess.run([sys.executable, "-c", "raise KeyboardInterrupt"], text=True,
                            capture_output=True, preexec_fn=as_a_foreground_job)
    assert process.returncode == python.returncode == -signal.SIGINT, (process.returncode,
                                                                       stderr)
    lines = stderr.splitlines()
    # (what the environment prints before is not the tool's: torch 2.0.1's TorchDynamo imports
    # an installed transformers, which may warn on stderr)
    assert "Traceback (most recent call last):" in lines, stderr
    start = lines.index("Traceback (most recent call last):")
    assert lines[start + 1].startswith(f'  File "{program}"'), stderr
    assert lines[-1] == "KeyboardInterrupt"


def test_ctrl_c_ignored_where_it_starts_stays_ignored_as_under_python(tmp_path):
    """nohup and a script's background jobs start a program with SIGINT ignored: Python keeps
    it ignored, and so does a program under emulate."""
    program = _write(tmp_path / "ignores.py", """
        import signal, sys, time
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        time.sleep(1.0)
        print("done", flush=True)
    """)

    def ignoring() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    outcomes = []
    for command in ([sys.executable, str(program)],
                    [sys.executable, "-m", "ipu_unit_scaling", "emulate", str(program)]):
        process = subprocess.Popen(command, env=_environment(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, preexec_fn=ignoring)
        try:
            assert process.stdout is not None
            first = process.stdout.readline()
            process.send_signal(signal.SIGINT)
            rest, stderr = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()
        outcomes.append((process.returncode, first + rest, stderr))
    assert outcomes[0] == (0, "True\ndone\n", ""), outcomes[0]
    assert outcomes[1] == outcomes[0], outcomes[1]


def test_spawned_and_forkserver_workers_import_poptorch(tmp_path):
    _write(tmp_path / "workers.py", """
        import multiprocessing
        import torch
        import poptorch

        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, index):
                return torch.tensor([float(index * index)])

        def standin_name(_):
            import poptorch
            return poptorch.__name__

        if __name__ == "__main__":
            loader = poptorch.DataLoader(poptorch.Options(), Squares(), batch_size=2,
                                         num_workers=2, multiprocessing_context="spawn")
            print(sorted(int(v) for batch in loader for v in batch.flatten()))
            for method in ("spawn", "forkserver"):
                with multiprocessing.get_context(method).Pool(1) as pool:
                    print(method, pool.map(standin_name, [0]))
    """)
    done = _emulate(["workers.py"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "[0, 1, 4, 9, 16, 25, 36, 49]",
        "spawn ['ipu_standins.poptorch']",
        "forkserver ['ipu_standins.poptorch']",
    ]


def test_nothing_is_left_in_the_temporary_directory(tmp_path):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    _write(tmp_path / "fails.py", "import subprocess, sys, poptorch\n"
           "subprocess.run([sys.executable, '-c', 'import poptorch'], check=True)\n"
           "raise SystemExit(4)\n")
    assert _emulate(["fails.py"], tmp_path, tmp=temporary).returncode == 4
    assert list(temporary.iterdir()) == []


def test_a_poptorch_beside_the_program_is_not_used_and_a_note_says_so(tmp_path):
    (tmp_path / "poptorch.py").write_text("raise SystemExit('the local poptorch.py ran')\n")
    (tmp_path / "popart").mkdir()
    (tmp_path / "popart" / "__init__.py").write_text("raise SystemExit('local popart ran')\n")
    _write(tmp_path / "prog.py", "import poptorch, popart\n"
           "print(poptorch.__name__, popart.__name__)\n")
    for args in (["prog.py"], ["-m", "prog"]):
        done = _emulate(args, tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "ipu_standins.poptorch ipu_standins.popart\n"
        note, = done.stderr.splitlines()
        assert note.startswith("ipu-unit-scaling emulate: note: poptorch.py, popart")
        assert "import popart, import poptorch gives the stand-in" in note


def test_popart_imports_as_poptorch_programs_use_it(tmp_path):
    _write(tmp_path / "prog.py", """
        import poptorch
        import popart

        options = poptorch.Options()
        options._Popart.set("syntheticDataMode", int(popart.SyntheticDataMode.RandomNormal))
        options._Popart.set("autoRecomputation", int(popart.RecomputationType.Pipeline))
        popart.getLogger().setLevel("ERR")
        print(popart.__version__.startswith(poptorch.__version__.split("+")[0]),
              options._Popart.options["syntheticDataMode"],
              options._Popart.options["autoRecomputation"])
        popart.Builder
    """)
    done = _emulate(["prog.py"], tmp_path)
    assert done.returncode == 1
    assert done.stdout == "True 2 3\n"
    assert done.stderr.splitlines()[-1].startswith(
        "AttributeError: module 'popart' has no attribute 'Builder' in the PopART stand-in")


def test_the_op_libraries_variable_is_the_stand_ins():
    from ipu_standins.poptorch_custom_ops import LIBRARIES_ENV
    from ipu_unit_scaling.apps.emulate import OP_LIBRARIES_ENV

    assert OP_LIBRARIES_ENV == LIBRARIES_ENV


def test_the_interpreters_flags_are_passed_on(tmp_path):
    _write(tmp_path / "prog.py", "import sys, poptorch\nprint(sys.flags.optimize)\n")
    done = subprocess.run([sys.executable, "-O", "-m", "ipu_unit_scaling", "emulate", "prog.py"],
                          cwd=tmp_path, env=_environment(), text=True, capture_output=True,
                          timeout=600)
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr

"""The command under hostile conditions of its own process: a closed or full standard output,
Ctrl-C while it starts, a model factory that exits, a figure that cannot be written, a broken
lock link; and a start that loads nothing heavy for ``--version`` and ``--help``. Each ends in
one line on stderr and a meaningful exit status."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import ONE_IPU as ONE_STAGE
from helpers import ROOT

from ipu_unit_scaling.apps import cli
from ipu_unit_scaling.apps.cli import main

HEAVY = ("torch", "matplotlib", "ipu_unit_scaling.loop.training_loop",
         "ipu_unit_scaling.training.run_config")
# A given model's config: the tiny GPT on one IPU, so the factory is what is refused.


def _command(*arguments: str, **options):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "ipu_unit_scaling", *arguments], env=env,
                          text=True, capture_output=options.pop("capture", True), **options)


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("arguments", [["--version"], ["--help"], ["train", "--help"],
                                       ["compare", "--help"]])
def test_version_and_help_load_neither_torch_nor_the_loop(arguments):
    code = ("import sys\nfrom ipu_unit_scaling.apps.cli import main\n"
            f"status = main({arguments!r})\n"
            f"heavy = [name for name in {HEAVY!r} if name in sys.modules]\n"
            "print('HEAVY', status, heavy)\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                            "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)
    assert result.stdout.splitlines()[-1] == "HEAVY 0 []", result.stdout[-500:]


def test_the_package_root_loads_its_names_when_used():
    code = ("import sys, ipu_unit_scaling as uu\n"
            "assert 'torch' not in sys.modules\n"
            "assert 'Linear' in dir(uu) and 'functional' in dir(uu)\n"
            "layer = uu.Linear(4, 3)\n"
            "from ipu_unit_scaling import functional, rules\n"
            "from ipu_unit_scaling.scale import scale\n"
            "assert callable(scale) and functional.gelu is uu.functional.gelu\n"
            "missing = [name for name in uu.__all__ if not hasattr(uu, name)]\n"
            "assert not missing, missing\n"
            "try:\n    uu.no_such_name\nexcept AttributeError:\n    print('OK')\n")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                            "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert result.stdout.strip() == "OK", result.stderr[-2000:]


def test_a_closed_standard_output_is_said_in_one_line():
    result = _command("--version", capture=False, stderr=subprocess.PIPE,
                      preexec_fn=lambda: os.close(1))
    assert result.returncode == 2
    assert "cannot write standard output: it is closed" in _one_line(result.stderr)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_standard_output_is_named():
    with open("/dev/full", "w") as full:
        result = _command("--version", capture=False, stdout=full, stderr=subprocess.PIPE)
    assert result.returncode == 2
    assert "cannot write standard output: No space left on device" in _one_line(result.stderr)


@pytest.fixture
def ctrl_c_as_at_a_terminal():
    """SIGINT as an interactive shell's foreground job has it, whatever this test process
    inherited (a script's background job starts with it ignored); put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def ctrl_c_ignored():
    """SIGINT ignored, as ``nohup`` and a script's background jobs start a command."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_the_command_loads_is_one_line(tmp_path, monkeypatch, capsys,
                                                    ctrl_c_as_at_a_terminal):
    loaded = cli.command_for

    def interrupted_while_loading(name):
        os.kill(os.getpid(), signal.SIGINT)  # held until the imports are done
        return loaded(name)

    monkeypatch.setattr(cli, "command_for", interrupted_while_loading)
    assert main(["compare", "--config", "tiny", "--run-dir", str(tmp_path / "run")]) == 130
    assert "interrupted before compare started" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
    # Ctrl-C works as usual again once the command runs.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_ignored_where_the_command_starts_stays_ignored(tmp_path, monkeypatch, capsys,
                                                              ctrl_c_ignored):
    loaded = cli.command_for
    seen = []

    def interrupted_while_loading(name):
        os.kill(os.getpid(), signal.SIGINT)  # ignored: the command goes on
        seen.append(signal.getsignal(signal.SIGINT))
        return loaded(name)

    monkeypatch.setattr(cli, "command_for", interrupted_while_loading)
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--set", "training.steps=2",
                 "training.eval_interval=0", *ONE_STAGE, "--run-dir", str(run_dir),
                 "--quiet"]) == 0
    assert seen == [signal.SIG_IGN]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_ctrl_c_anywhere_in_main_is_one_line(monkeypatch, capsys):
    def stopped(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "command_for", stopped)
    assert main(["train", "--config", "tiny"]) == 130
    assert _one_line(capsys.readouterr().err) == "ipu-unit-scaling: interrupted\n"


@pytest.mark.parametrize("source, words", [
    (None, "sys:exit called sys.exit(<GPTConfig>) instead of returning a model"),
    ("import sys\nsys.exit(3)\n", "importing 'exits_here' called sys.exit(3)"),
    ("def build(settings):\n    return 5\n", "returned int, not a torch.nn.Module"),
])
def test_a_factory_that_exits_or_returns_no_module_is_refused(tmp_path, monkeypatch, capsys,
                                                              source, words):
    factory = "sys:exit"
    if source is not None:
        (tmp_path / "exits_here.py").write_text(source)
        monkeypatch.chdir(tmp_path)
        monkeypatch.syspath_prepend(str(tmp_path))
        factory = "exits_here:build"
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--set", f"model.factory={factory}", *ONE_STAGE,
                 "--run-dir", str(run_dir), "--quiet"]) == 2
    assert words in _one_line(capsys.readouterr().err)
    assert not run_dir.exists()


def test_a_figure_that_cannot_be_written_names_itself(tmp_path, capsys):
    run_dir = tmp_path / "run"
    steps = ["--set", "training.steps=2", "training.eval_interval=0"]
    assert main(["train", "--config", "tiny", *steps, "--run-dir", str(run_dir),
                 "--quiet"]) == 0
    (run_dir / "loss.png").unlink()
    (run_dir / "loss.png").mkdir()
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "--set", "training.steps=3",
                 "--quiet"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert f"loss.png not written: cannot replace {run_dir / 'loss.png'}: it is a directory" \
        in err and ".tmp" not in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("completed", 3)  # the run itself is whole


@pytest.mark.parametrize("command", [["evaluate"], ["sample", "--tokens", "2"]])
def test_a_broken_lock_link_is_named(tmp_path, capsys, command):
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--set", "training.steps=1",
                 "training.eval_interval=0", "--run-dir", str(run_dir), "--quiet"]) == 0
    os.symlink(tmp_path / "gone" / "lock", run_dir / ".lock")
    capsys.readouterr()
    assert main([command[0], str(run_dir), *command[1:]]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "its .lock is a broken symbolic link" in err and "no such directory" not in err


@pytest.mark.parametrize("fails", ["pwrite", "open"])
def test_a_full_disk_at_the_start_leaves_nothing_behind(tmp_path, monkeypatch, capsys, fails):
    """The disk fills as the run takes its lock: the holder's name cannot be written (or, with
    no room for a new file, the lock file cannot be made). What the command created goes."""
    import errno

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if fails == "pwrite":
        def pwrite(fd, data, offset):
            raise full
        monkeypatch.setattr(os, "pwrite", pwrite)
    else:
        real_open = os.open

        def open_(path, flags, *args, **kwargs):
            if str(path).endswith(".lock") and flags & os.O_CREAT:
                raise full
            return real_open(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", open_)
    made = tmp_path / "new"
    assert main(["train", "--config", "tiny", "--run-dir", str(made / "run"), "--quiet"]) == 2
    assert "No space left on device" in _one_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []


def test_a_relative_data_path_is_saved_absolute(tmp_path, monkeypatch, capsys):
    from ipu_unit_scaling.training.run_config import setting_differences

    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "book.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    monkeypatch.chdir(here)
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--data", "book.txt", "--set", "training.steps=1",
                 "training.eval_interval=0", "--run-dir", str(run_dir), "--quiet"]) == 0
    assert f"path: {here / 'book.txt'}" in (run_dir / "config.yaml").read_text()
    monkeypatch.chdir(elsewhere)  # read from another directory
    assert main(["evaluate", str(run_dir), "--precision", "fp32", "--quiet"]) == 0
    assert main(["train", "--resume", str(run_dir), "--set", "training.steps=2",
                 "--quiet"]) == 0
    # A resume that names the text relative to where it is given saves it absolute too.
    assert main(["train", "--resume", str(run_dir), "--set", "training.steps=3",
                 "data.path=../here/book.txt", "--quiet"]) == 0
    assert f"path: {here / 'book.txt'}" in (run_dir / "config.yaml").read_text()
    # A run saved with a relative path names the same file as its absolute path.
    monkeypatch.chdir(here)
    assert setting_differences({"data": {"path": "book.txt"}},
                               {"data": {"path": str(here / "book.txt")}}) == []
    assert setting_differences({"data": {"path": "book.txt"}}, {"data": {"path": "other"}})


def test_evaluate_refuses_an_out_that_is_a_file_before_evaluating(tmp_path, capsys):
    run_dir, out = tmp_path / "run", tmp_path / "afile"
    assert main(["train", "--config", "tiny", "--set", "training.steps=1",
                 "training.eval_interval=0", "--run-dir", str(run_dir), "--quiet"]) == 0
    out.write_text("notes")
    capsys.readouterr()
    assert main(["evaluate", str(run_dir), "--out", str(out)]) == 2
    err = _one_line(capsys.readouterr().err)  # no progress line: nothing was evaluated
    assert f"--out {out}: not a directory" in err
    assert out.read_text() == "notes"

"""The README's shell commands, pasted in order into a fresh directory, work.

Structurally for all of them: each parses with the command's own parser, and every run
directory a command reads (``evaluate DIR``, ``sample DIR``, ``train --resume DIR``, ...) was
made by an earlier one (``--run-dir DIR``). Then the commands that pass run directories along
run for real, in a fresh directory, in the README's order, with their training shortened to a
few steps.
"""
from __future__ import annotations

import re
import shlex
from typing import List, Optional, Tuple

from helpers import ROOT

from ipu_unit_scaling.apps.cli import build_parser, main

README = ROOT / "README.md"
# Options whose value names a run directory the command reads.
READS = ("--resume", "--init-from")
# Commands whose first positional argument names a run directory they read.
READ_FIRST = ("evaluate", "sample", "health")


def readme_commands() -> List[List[str]]:
    """The argument lists of every ``ipu-unit-scaling`` (or ``python -m ipu_unit_scaling``
    under torchrun) command in the README's bash blocks, in order, without the program."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    commands = []
    for block in blocks:
        for line in block.splitlines():
            for part in " ".join(shlex.split(line, comments=True)).split(" && "):
                words = shlex.split(part)
                if words[:1] == ["ipu-unit-scaling"]:
                    commands.append(words[1:])
                elif words[:1] == ["torchrun"] and "ipu_unit_scaling" in words:
                    commands.append(words[words.index("ipu_unit_scaling") + 1:])
    return commands


def run_dirs(argv: List[str]) -> Tuple[Optional[str], List[str]]:
    """(the run directory ``argv`` makes, if named; the run directories it reads)."""
    made = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else None
    read = [argv[argv.index(option) + 1] for option in READS if option in argv]
    if argv and argv[0] in READ_FIRST:
        read.append(argv[1])
    return made, read


def test_the_readme_shows_the_commands_that_need_run_directories():
    commands = readme_commands()
    assert len(commands) >= 10
    assert any(argv[:1] == ["evaluate"] for argv in commands)
    assert any("--resume" in argv for argv in commands)


def test_every_run_directory_a_readme_command_reads_an_earlier_one_makes():
    made: List[str] = []
    parser = build_parser()
    for argv in readme_commands():
        if argv not in (["--version"], ["--help"]):
            parser.parse_args(argv)  # every option exists (exits 2 otherwise)
        target, read = run_dirs(argv)
        for directory in read:
            assert directory in made, f"{' '.join(argv)}: no earlier command makes {directory}"
        if target is not None:
            assert target not in made, f"{' '.join(argv)}: {target} was made before"
            made.append(target)


def shortened(argv: List[str]) -> List[str]:
    """``argv`` training a few steps: a resume 2 more than its run, anything else 2."""
    steps = "4" if "--resume" in argv else "2"
    argv = [re.sub(r"^training\.steps=\d+$", f"training.steps={steps}", word) for word in argv]
    if argv[0] == "train" and not any(w.startswith("training.steps=") for w in argv):
        argv += ["--set", f"training.steps={steps}"]
    if argv[0] == "sample":
        argv = [w if not (i and argv[i - 1] == "--tokens") else "5" for i, w in enumerate(argv)]
    return argv


def test_the_readme_commands_that_pass_run_directories_along_run_in_order(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    chain = [argv for argv in readme_commands() if any(run_dirs(argv))]
    assert chain, "the README passes no run directory along"
    for argv in chain:
        argv = shortened(argv)
        if argv[0] == "train" and "--config" not in argv and "--resume" not in argv:
            argv += ["--config", "tiny"]  # the default model, smaller: seconds, not minutes
        status = main(argv + ["--quiet"] if argv[0] == "train" else argv)
        out, err = capsys.readouterr()
        assert status == 0, f"{' '.join(argv)} exited {status}: {err}"
    for argv in chain:
        target, _ = run_dirs(argv)
        if target is not None:
            assert (tmp_path / target / "summary.json").is_file()


def test_the_readme_version_line_works(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("ipu-unit-scaling ")

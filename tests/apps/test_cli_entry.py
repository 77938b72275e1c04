"""The bare command and ``--version``: what a user types first."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

from helpers import ROOT

import ipu_unit_scaling
from ipu_unit_scaling.apps.cli import build_parser, main


def _subcommands() -> list:
    (subparsers,) = [action for action in build_parser()._actions
                     if isinstance(action, argparse._SubParsersAction)]
    return list(subparsers.choices)


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"ipu-unit-scaling {ipu_unit_scaling.__version__}\n"
    assert captured.err == ""
    assert re.fullmatch(r"\d+\.\d+\.\d+", ipu_unit_scaling.__version__)


def test_the_package_declares_the_version_the_command_prints():
    declared = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split()
    assert declared[-1] == ipu_unit_scaling.__version__


def test_bare_command_hint_names_every_subcommand(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    hint = captured.err.partition("--help' for ")[2]
    named = set(re.findall(r"[a-z]+", hint))
    missing = [command for command in _subcommands() if command not in named]
    assert not missing, f"the hint leaves out {missing}: {hint}"

"""``poptorch._logging`` of the PopTorch stand-in against PopTorch's (python/_logging.py): the
``poptorch::python`` logger, its level names and legacy integers, the refusals, and the level
``POPTORCH_LOG_LEVEL`` sets at import (WARN without it)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

import ipu_standins.poptorch as poptorch
from ipu_standins.poptorch import _logging


@pytest.fixture
def restore_level():
    before = _logging.logger.level
    yield
    _logging.logger.setLevel(before)


@pytest.mark.parametrize("name, level", [
    ("TRACE", logging.DEBUG), ("DEBUG", logging.DEBUG), ("INFO", logging.INFO),
    ("WARN", logging.WARNING), ("ERR", logging.ERROR), ("OFF", logging.CRITICAL),
    ("TRACE_ALL", logging.DEBUG), ("DEBUG_IR", logging.DEBUG)])
def test_each_level_name_sets_the_python_logger(restore_level, name, level):
    poptorch.setLogLevel(name)
    assert logging.getLogger("poptorch::python") is _logging.logger
    assert _logging.logger.level == level


@pytest.mark.parametrize("number, level", [
    (0, logging.DEBUG), (1, logging.DEBUG), (2, logging.INFO), (3, logging.WARNING),
    (4, logging.ERROR), (6, logging.CRITICAL)])
def test_legacy_integers_name_the_levels(restore_level, number, level):
    _logging.logger.setLevel(logging.NOTSET)
    poptorch.setLogLevel(number)
    assert _logging.logger.level == level


def test_unknown_levels_are_refused_with_the_public_names(restore_level):
    with pytest.raises(ValueError, match="^Invalid log level integer$"):
        poptorch.setLogLevel(5)
    # The internal names (TRACE_ALL, DEBUG_IR) are accepted but not offered.
    with pytest.raises(ValueError, match=r"^Unknown log level: LOUD\. Valid values are "
                                         r"DEBUG, ERR, INFO, OFF, TRACE and WARN$"):
        poptorch.setLogLevel("LOUD")


def test_the_popart_level_takes_names_only(monkeypatch):
    monkeypatch.setattr(_logging, "_popart_level", "WARN")
    _logging.setPopartLogLevel("ERR")
    assert _logging._popart_level == "ERR"
    for bad in ("LOUD", 3):
        with pytest.raises(ValueError, match="^Level must be one of TRACE, "):
            _logging.setPopartLogLevel(bad)
    assert _logging._popart_level == "ERR"


@pytest.mark.parametrize("environment, level", [(None, logging.WARNING),
                                                ("INFO", logging.INFO),
                                                ("ERR", logging.ERROR)])
def test_the_level_at_import_comes_from_poptorch_log_level(environment, level):
    env = {k: v for k, v in os.environ.items() if k != "POPTORCH_LOG_LEVEL"}
    if environment is not None:
        env["POPTORCH_LOG_LEVEL"] = environment
    code = ("import logging, ipu_standins.poptorch._logging\n"
            "print(logging.getLogger('poptorch::python').level)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == level

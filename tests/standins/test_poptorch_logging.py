"""``poptorch._logging`` of the PopTorch stand-in against PopTorch's (python/_logging.py): the
``poptorch::python`` logger, its level names and legacy integers, the refusals, and the level
``POPTORCH_LOG_LEVEL`` sets at import (WARN without it)."""
from __future__ import annotations

import importlib.util
import logging

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


def _import_afresh():
    """Run the module's code again, as a first import does (the logger is the same one)."""
    spec = importlib.util.spec_from_file_location("fresh_poptorch_logging", _logging.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


@pytest.mark.parametrize("environment, level", [(None, logging.WARNING),
                                                ("INFO", logging.INFO),
                                                ("ERR", logging.ERROR)])
def test_the_level_at_import_comes_from_poptorch_log_level(restore_level, monkeypatch,
                                                           environment, level):
    monkeypatch.delenv("POPTORCH_LOG_LEVEL", raising=False)
    if environment is not None:
        monkeypatch.setenv("POPTORCH_LOG_LEVEL", environment)
    _logging.logger.setLevel(logging.NOTSET)
    _import_afresh()
    assert _logging.logger.level == level


def test_an_unknown_level_in_the_environment_fails_the_import(restore_level, monkeypatch):
    monkeypatch.setenv("POPTORCH_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="Unknown log level: LOUD"):
        _import_afresh()

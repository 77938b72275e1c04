"""``poptorch._logging``: PopTorch's log levels (accepted; the stand-in logs through Python's
``logging`` under the name ``poptorch::python``)."""
from __future__ import annotations

import logging
from typing import Union

__all__ = ["logger", "setLogLevel", "setPopartLogLevel"]

logger = logging.getLogger("poptorch::python")

_LEVELS = {"TRACE": logging.DEBUG, "TRACE_ALL": logging.DEBUG, "DEBUG": logging.DEBUG,
           "DEBUG_IR": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
           "ERR": logging.ERROR, "ERR_ONLY": logging.ERROR, "OFF": logging.CRITICAL + 1}
_popart_level = "WARN"


def setLogLevel(level: Union[str, int], update_cpp: bool = True) -> None:
    if isinstance(level, int):
        names = list(_LEVELS)
        if not 0 <= level < len(names):
            raise ValueError(f"Invalid log level integer: {level}")
        level = names[level]
    if level not in _LEVELS:
        raise ValueError(f"Unknown log level: {level}. Valid values are {list(_LEVELS)}")
    logger.setLevel(_LEVELS[level])


def setPopartLogLevel(level: Union[str, int]) -> None:
    global _popart_level
    _popart_level = str(level)

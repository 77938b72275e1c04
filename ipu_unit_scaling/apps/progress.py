"""The overall progress line of a command made of many runs (``compare``, ``sweep``):
``compare [3/12] fp8-naive: ...``, with the time so far and an estimate of the time left."""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["RunCounter", "duration_text"]


def duration_text(seconds: float) -> str:
    """``42 s``, ``3 min 05 s`` or ``1 h 02 min``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class RunCounter:
    """``[k/n]`` lines for the ``total`` runs of ``command``; nothing when ``quiet``.

    The time left is the mean time of the runs trained so far (runs reused from an earlier
    invocation cost nothing and are not counted) times the runs still to come.
    """

    def __init__(self, command: str, total: int, quiet: bool = False,
                 say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.command, self.total, self.quiet, self.say = command, total, quiet, say
        self.clock = clock
        self.began = clock()
        self.trained_s = 0.0
        self.trained = 0
        self.done = 0  # runs finished, reused ones included
        self._started: Optional[float] = None

    def left(self, done: int) -> Optional[str]:
        """``about 4 min 10 s left`` once a run was trained and runs remain, else None."""
        remaining = self.total - done
        if not self.trained or remaining <= 0:
            return None
        return f"about {duration_text(self.trained_s / self.trained * remaining)} left"

    def start(self, index: int, name: str, action: Optional[str] = None) -> None:
        """Run ``index`` (from 1) starts; ``action`` says what happens to it (no line without
        one)."""
        self._started = self.clock()
        if action is not None and not self.quiet:
            left = self.left(index - 1)
            self.say(f"{self.command} [{index}/{self.total}] {name}: {action}"
                     + (f" ({left})" if left else ""))

    def finish(self, index: int, name: str, result: str, trained: bool = True) -> None:
        """Run ``index`` ended with ``result``; ``trained``: it ran now (not reused)."""
        if trained and self._started is not None:
            self.trained_s += self.clock() - self._started
            self.trained += 1
        self._started = None
        self.done += 1
        if not self.quiet:
            left = self.left(index)
            elapsed = duration_text(self.clock() - self.began)
            self.say(f"{self.command} [{index}/{self.total}] {name}: {result} "
                     f"({elapsed} so far" + (f", {left})" if left else ")"))

"""The ``ipu-unit-scaling`` process: what it does to its signals, descriptors and streams.

Apart from the command line's parsing (:mod:`.cli`): Ctrl-C held while a command loads, standard
descriptors kept taken, streams whose reader may go away, characters the terminal cannot show
escaped, and torchrun's rank. It imports nothing of the package, so that :mod:`.cli` installs
the first of these before its own imports.
"""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from typing import Any, Iterator, List, Optional, Tuple

__all__ = ["hold_ctrl_c_from_the_start", "ctrl_c_held", "ReaderMayLeave",
           "keep_standard_descriptors_taken", "escape_what_the_terminal_cannot_show",
           "torchrun_rank_and_size"]


def hold_ctrl_c_from_the_start() -> None:
    """Where this process is the command itself (its console script, ``python -m
    ipu_unit_scaling``), Ctrl-C waits from here until the command's imports are done (see
    :func:`ctrl_c_held`), instead of cutting an import with a traceback; the early handler
    collects the signals that came. Imported by other code, nothing changes."""
    program = sys.argv[0] if sys.argv and isinstance(sys.argv[0], str) else ""
    if (os.path.basename(program) == "ipu-unit-scaling"
            or program.endswith(os.path.join("ipu_unit_scaling", "__main__.py"))) \
            and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _EarlyHandler())


class _EarlyHandler:
    def __init__(self) -> None:
        self.held: List[int] = []

    def __call__(self, signum: int, frame: Any) -> None:
        self.held.append(signum)


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[List[int]]:
    """Ctrl-C (SIGINT) waits until the block ends; the list yielded then holds the signal if
    one came. Off the main thread, where no handler can be set, nothing is held; where the
    process started with Ctrl-C ignored (nohup, a script's background job), it stays ignored,
    as Python leaves it."""
    held: List[int] = []
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield held
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    if isinstance(previous, _EarlyHandler):  # held since the process started: Ctrl-C stops
        held += previous.held                 # the command as usual from now on
        previous = signal.default_int_handler
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


def keep_standard_descriptors_taken() -> None:
    """A descriptor 0, 1 or 2 that the shell closed (``>&-``) is opened on the null device:
    else the next file a run opens would get its number, and whatever writes to standard
    output (a library's C code, a child process) would write into it."""
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError:
            try:
                null = os.open(os.devnull, os.O_RDWR)
                if null != descriptor:
                    os.dup2(null, descriptor)
                    os.close(null)
            except OSError:
                pass


class ReaderMayLeave:
    """stdout or stderr, whose reader may go away (``... | head``): from then on what is
    written is dropped (``left`` says so), so that a run goes on to its end and its files
    instead of dying of its log. A stream that cannot be written (closed, ``>&-``; full,
    ``>/dev/full``) is dropped the same way; ``failed`` then says why (an OSError naming
    ``name``), for the command to report at its end."""

    def __init__(self, stream: Any, name: str) -> None:
        self.name = name
        self.left = False
        self.failed: Optional[OSError] = None
        if stream is None:  # the shell closed it: Python gives no stream at all
            stream = open(os.devnull, "w")
            self.left = True
            self.failed = OSError(errno.EBADF, "it is closed", name)
        self._stream = stream

    def write(self, text: str) -> int:
        if not self.left:
            try:
                return int(self._stream.write(text))
            except OSError as error:
                self._leave(error)
        return len(text)

    def flush(self) -> None:
        if not self.left:
            try:
                self._stream.flush()
            except OSError as error:
                self._leave(error)

    def _leave(self, error: OSError) -> None:
        self.left = True
        if not isinstance(error, BrokenPipeError):
            self.failed = OSError(error.errno, error.strerror or str(error), self.name)
        try:  # the interpreter flushes the stream once more at exit: into the null device
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture)
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def escape_what_the_terminal_cannot_show() -> None:
    # Characters the output's encoding lacks (u-μP where it is ASCII, a path of undecodable
    # bytes) come out as backslash escapes instead of stopping the command with a traceback.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream that cannot change now: leave it
                pass


def torchrun_rank_and_size() -> Tuple[int, int]:
    """This process's rank and the number of processes, as torchrun set them; (0, 1) when it
    did not start this one."""
    try:
        return int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    except ValueError:
        return 0, 1

"""The run directory: its files, how they are written, locked and checked on resume.

Guarantees, whatever moment a run is killed at:

- every file but the append-only ``metrics.csv`` is written whole or not at all: to a temporary
  file in the same directory, fsynced, then renamed over the old one (the directory is fsynced
  too). Temporary files a killed run leaves behind are removed by the next run;
- ``checkpoint.pt`` starts with a header line holding the SHA-256 of the rest, checked on load;
- one process at a time writes a run directory: an advisory lock (``flock``) on ``.lock`` is
  held for the whole run, and a second writer is refused with the holder's process id. Readers
  (``evaluate``, ``sample``) share the lock: they are refused while a run writes, and a writer
  is refused while they read. Where ``fcntl`` is missing (Windows) there is no lock and
  concurrent runs are not detected;
- the checkpoint records the SHA-256 of the tokenizer it was trained with: an edited
  ``tokenizer.json`` is refused by every reader of the run (:func:`check_tokenizer`);
- a resume refuses, in one line naming the file, a missing, empty or damaged artefact.
"""
from __future__ import annotations

import datetime
import errno
import itertools
import json
import os
import re
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

try:
    import fcntl
except ImportError:  # not POSIX: runs go unlocked
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "RunError", "CONFIG_FILE", "TOKENIZER_FILE", "TASK_FILE", "METRICS_FILE", "CHECKPOINT_FILE",
    "SUMMARY_FILE", "PLOT_FILE", "SCALE_REPORT_FILE", "TENSORBOARD_DIR", "LOCK_FILE",
    "TELEMETRY_FILE", "HEALTH_PLOT_FILE",
    "ARTEFACTS", "COMPARE_FILES",
    "EVALUATION_FILES", "METRIC_FIELDS", "leftovers", "error_naming", "not_a_directory",
    "state_mismatch",
    "atomic_write", "remove_temporaries", "RunLock", "make_run_dir", "make_unique_run_dir",
    "remove_refused_start", "read_json", "read_regular_file", "NotARegularFile",
    "check_own_kind",
    "INIT_FROM_FILE",
]

CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
TASK_FILE = "task.json"  # what the run trains, for tasks other than the causal LM
METRICS_FILE = "metrics.csv"
CHECKPOINT_FILE = "checkpoint.pt"
SUMMARY_FILE = "summary.json"
PLOT_FILE = "loss.png"
SCALE_REPORT_FILE = "scale_report.csv"
TELEMETRY_FILE = "telemetry.csv"  # see ipu_unit_scaling.training.telemetry_log
HEALTH_PLOT_FILE = "health.png"
TENSORBOARD_DIR = "tensorboard"  # the run's scalars as TensorBoard event files, a directory
# A fine-tuning run's start (the run it fine-tunes), written before its config: a run killed
# before its first checkpoint resumes as the fine-tune it was.
INIT_FROM_FILE = "init_from.json"
LOCK_FILE = ".lock"
ARTEFACTS = (CONFIG_FILE, TOKENIZER_FILE, TASK_FILE, INIT_FROM_FILE, METRICS_FILE,
             CHECKPOINT_FILE, SUMMARY_FILE, PLOT_FILE, SCALE_REPORT_FILE, TELEMETRY_FILE,
             HEALTH_PLOT_FILE)
COMPARE_FILES = ("compare.md", "compare.json", "compare.png")
EVALUATION_FILES = ("evaluate.md", "evaluate.json")  # what `evaluate` adds to a trained run
METRIC_FIELDS = ("step", "lr", "train_loss", "val_loss", "tokens_per_s", "elapsed_s")
TEMPORARY_SUFFIX = ".tmp"

CHECKPOINT_MAGIC = b"ipu-unit-scaling checkpoint 1"


class RunError(ValueError):
    """A run that cannot start or resume as asked (bad run directory, damaged artefact)."""


def os_error_reason(error: OSError) -> str:
    """The reason an OSError gives (its strerror), for messages that name the path."""
    return error.strerror or str(error)


def error_naming(path: Path, error: OSError) -> OSError:
    """``error`` naming ``path``: os.write's errors (a full disk, say) name no file."""
    if error.filename is not None:
        return error
    return OSError(error.errno, os_error_reason(error), str(path))


def not_a_directory(path: Path) -> Optional[str]:
    """None where ``path`` is a directory, else why not, in words to follow "cannot ...
    PATH: " (so that a symbolic link loop does not read as a missing directory)."""
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "its path holds a symbolic link loop (too many levels of symbolic links)"
        if error.errno == errno.ENOENT and os.path.islink(path):
            return f"it is a broken symbolic link (to {os.readlink(path)})"
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            return "no such directory"
        return os_error_reason(error)
    except ValueError as error:  # a NUL byte in the name
        return f"not a usable path ({error})"
    return "not a directory"


def state_mismatch(error: BaseException) -> str:
    """A ``load_state_dict`` error in one line: its first problem and how many more there are
    (torch lists one per line, after a heading that says only which module)."""
    lines = [" ".join(line.split()) for line in str(error).splitlines()]
    problems = [line for line in lines[1:] if line] or [line for line in lines if line]
    if not problems:
        return type(error).__name__
    first = re.sub(r"torch\.Size\((\[[^\]]*\])\)", r"\1", problems[0]).rstrip(".")
    return first + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


# ------------------------------------------------------------------------------ atomic writes


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that it always holds the old or the new bytes, whole."""
    path = Path(path)
    try:
        handle, temporary = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=TEMPORARY_SUFFIX, dir=path.parent
        )
    except OSError as error:
        raise RunError(f"cannot write {path}: {os_error_reason(error)}") from None
    try:
        try:
            os.fchmod(handle, 0o666 & ~_umask())  # mkstemp's 0600 would hide results from others
            view = memoryview(data)
            while view:
                view = view[os.write(handle, view):]
            os.fsync(handle)
        finally:
            os.close(handle)
        os.replace(temporary, path)
    except BaseException as error:
        try:
            os.remove(temporary)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise error_naming(path, error) from None
        raise
    _fsync_directory(path.parent)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_directory(directory: Path) -> None:
    # Makes the rename itself durable; not possible on every platform, harmless to skip there.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _is_temporary(name: str) -> bool:
    # Ours: ".<artefact>.<random>.tmp" (and "<artefact>...tmp" from earlier versions).
    if not name.endswith(TEMPORARY_SUFFIX):
        return False
    stem = name[1:] if name.startswith(".") else name
    return any(stem.startswith(artefact + ".")
               for artefact in ARTEFACTS + COMPARE_FILES + EVALUATION_FILES)


def remove_temporaries(run_dir: Path) -> List[str]:
    """Delete temporary files left by killed writes (call with the lock held)."""
    removed = []
    for entry in _entries(run_dir):
        if _is_temporary(entry.name):
            try:
                entry.unlink()
            except OSError as error:
                raise RunError(f"cannot remove {entry}: {os_error_reason(error)}") from None
            removed.append(entry.name)
    return removed


def _entries(run_dir: Path) -> List[Path]:
    try:
        return sorted(run_dir.iterdir())
    except OSError as error:
        raise RunError(f"cannot read run directory {run_dir}: {os_error_reason(error)}") from None


# ------------------------------------------------------------------------------ the directory


def make_run_dir(run_dir: Path) -> List[Path]:
    """Create ``run_dir`` (and its parents) if needed; returns the directories it created,
    outermost first (for :func:`remove_refused_start`). One-line errors for every failure."""
    run_dir = Path(run_dir)
    _check_name(run_dir)
    try:
        created = _make_directories(run_dir)
    except OSError as error:
        raise RunError(f"cannot create run directory {run_dir}: {os_error_reason(error)}") from None
    problem = not_a_directory(run_dir)
    if problem == "not a directory":
        raise RunError(f"run directory {run_dir} exists and is not a directory")
    if problem:
        raise RunError(f"cannot create run directory {run_dir}: {problem}")
    return created


def make_unique_run_dir(parent: Path, name: str) -> Tuple[Path, List[Path]]:
    """A new directory ``parent/name``, or ``name-2``, ``name-3``, ... where that is taken (by
    a run started in the same second, say); returns it and the directories created, outermost
    first. Creating a directory is atomic, so runs started together never share one."""
    parent = Path(parent)
    _check_name(parent)
    try:
        created = _make_directories(parent)
        problem = not_a_directory(parent)
    except OSError as error:
        problem = os_error_reason(error)
    if problem:
        raise RunError(f"cannot create run directory {parent / name}: in {parent}: {problem}")
    for number in itertools.count(1):
        run_dir = Path(parent) / (name if number == 1 else f"{name}-{number}")
        _check_name(run_dir)
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        except OSError as error:
            raise RunError(f"cannot create run directory {run_dir}: "
                           f"{os_error_reason(error)}") from None
        return run_dir, created + [run_dir]
    raise AssertionError("unreachable")  # itertools.count never ends


def _check_name(run_dir: Path) -> None:
    text = str(run_dir)
    if "\0" in text:
        raise RunError(f"run directory {text!r} is not a usable path: it holds a NUL byte")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes: every message and summary would carry them
        raw = os.fsencode(text)
        raise RunError(f"run directory {raw!r} is not a usable path: its name is not UTF-8; "
                       "choose a UTF-8 name") from None


def _make_directories(run_dir: Path) -> List[Path]:
    missing = []
    path = run_dir
    while not os.path.lexists(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:  # made meanwhile by another process: not ours to remove
            continue
        created.append(path)
    return created


# What a start writes into a run directory before its first step: nothing a later run can use.
_START_FILES = (LOCK_FILE, CONFIG_FILE, TOKENIZER_FILE, TASK_FILE, INIT_FROM_FILE)


def remove_refused_start(created: Sequence[Path]) -> None:
    """After a command failed, remove the directories it created (``created``, from
    :func:`make_run_dir`, outermost first) where they hold nothing but what a start writes
    (the lock, config and tokenizer, temporary files, in subdirectories too). A directory in
    use by another run, or holding anything else, stays as it is."""
    if not created:
        return
    run_dir = Path(created[-1])
    try:
        with RunLock(run_dir, names_holder=False):  # a full disk takes no holder's name
            if not _only_start_files(run_dir):
                return
            _remove_start_files(run_dir)
    except (RunError, OSError):
        try:  # no lock file could be made there (a full disk): only an empty one goes
            run_dir.rmdir()
        except OSError:
            return
    for directory in reversed(created[:-1]):
        try:
            Path(directory).rmdir()
        except OSError:  # not empty: something else was put there meanwhile
            return


def _only_start_files(directory: Path) -> bool:
    for entry in directory.iterdir():
        if entry.is_symlink():
            return False
        if entry.is_dir():
            if not _only_start_files(entry):
                return False
        elif entry.name not in _START_FILES and not _is_temporary(entry.name):
            return False
    return True


def _remove_start_files(directory: Path) -> None:
    for entry in directory.iterdir():
        if entry.is_dir():
            _remove_start_files(entry)
        else:
            entry.unlink()
    directory.rmdir()


def leftovers(run_dir: Path) -> List[Path]:
    """Artefacts of an earlier run in ``run_dir``; RunError if it holds anything else."""
    found = []
    for entry in _entries(run_dir):
        if entry.name == LOCK_FILE or _is_temporary(entry.name):
            continue
        if entry.name == TENSORBOARD_DIR and entry.is_dir():
            found.append(entry)
            continue
        if entry.name not in ARTEFACTS or not entry.is_file():
            raise RunError(
                f"run directory {run_dir} is not empty ({entry.name}); choose another --run-dir"
            )
        found.append(entry)
    return found


def check_own_kind(run_dir: Path, command: str, files: Sequence[str],
                   directory: Any) -> None:
    """RunError unless ``run_dir`` is empty or holds only what ``command`` (compare, sweep)
    writes there: the ``files`` of its results, directories whose names ``directory(name)``
    accepts (its runs), the lock and temporary files. A train run, or a folder of notes, is
    not taken for one (``--run-dir`` of these commands is theirs)."""
    for entry in _entries(run_dir):
        name = entry.name
        if name == LOCK_FILE or _is_temporary(name):
            continue
        if entry.is_symlink():
            ok = False
        elif entry.is_dir():
            ok = bool(directory(name))
        else:
            ok = name in files and entry.is_file()
        if not ok:
            what = "a run of train" if name in ARTEFACTS else "not one of its results"
            raise RunError(f"run directory {run_dir} is not a {command} directory: it holds "
                           f"{name} ({what}); nothing was changed: choose another --run-dir")


class RunLock:
    """An advisory lock on a run directory: exclusive for a run that writes it (held from its
    start to its end), shared with ``shared=True`` for commands that only read it.

    A writer records who holds the lock in the lock file, so that whoever it refuses can say
    so. Readers write nothing: they may read a directory they cannot write to (no lock file
    there means no run is writing it).
    """

    def __init__(self, run_dir: Path, shared: bool = False, action: str = "read",
                 names_holder: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.shared = shared
        # False: a writer that records no holder (a clean-up, which must work on a full disk)
        self.names_holder = names_holder
        self.action = action  # what a refused reader could not do ("evaluate", "sample")
        self._fd: Optional[int] = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> None:
        fd = self._open_reading() if self.shared else self._open_writing()
        if fd is None:
            return
        if fcntl is not None:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except OSError as error:
                holder = _read_holder(fd)
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunError(self._busy(holder)) from None
                raise RunError(f"cannot lock run directory {self.run_dir}: "
                               f"{os_error_reason(error)}") from None
            if not self._still_the_lock_file(fd):
                # Its holder ended and removed it between our open and our lock: take the
                # lock file there is now (a new one if none is).
                os.close(fd)
                return self.acquire()
        if not self.shared and self.names_holder:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, _holder_text().encode("utf-8"), 0)
            except OSError as error:
                os.close(fd)
                raise RunError(f"cannot write to run directory {self.run_dir}: "
                               f"{os_error_reason(error)}") from None
        self._fd = fd

    def _open_writing(self) -> int:
        try:
            return os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise RunError(f"cannot write to run directory {self.run_dir}: "
                           f"{self._broken_link() or os_error_reason(error)}") from None

    def _broken_link(self) -> str:
        """Why the lock file cannot be opened when it is a symbolic link to nowhere (opening
        it says only "no such file"), else ""."""
        path = self.run_dir / LOCK_FILE
        try:
            if os.path.islink(path) and not os.path.exists(path):
                return (f"its {LOCK_FILE} is a broken symbolic link (to {os.readlink(path)}); "
                        "no run holds it: remove it")
        except (OSError, ValueError):
            pass
        return ""

    def _open_reading(self) -> Optional[int]:
        problem = not_a_directory(self.run_dir)
        if problem:
            raise RunError(f"cannot {self.action} {self.run_dir}: {problem}")
        path = self.run_dir / LOCK_FILE
        for flags in (os.O_RDONLY, os.O_RDONLY | os.O_CREAT):
            try:
                return os.open(path, flags, 0o644)
            except FileNotFoundError:
                continue  # no run has locked it yet: create the file, so that one cannot start
            except NotADirectoryError:
                break
            except OSError as error:
                if flags & os.O_CREAT and error.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
                    return None  # a directory nobody here can write: no writer to wait for
                raise RunError(f"cannot {self.action} {self.run_dir}: cannot open its "
                               f"{LOCK_FILE}: {os_error_reason(error)}") from None
        raise RunError(f"cannot {self.action} {self.run_dir}: "
                       f"{self._broken_link() or 'no such directory'}")

    def _busy(self, holder: str) -> str:
        if self.shared:
            return (f"cannot {self.action} {self.run_dir}: it is in use by {holder}, a run "
                    "writing it; wait for it to finish")
        return (f"run directory {self.run_dir} is in use by {holder}; wait for it to finish "
                "or choose another --run-dir")

    def release(self) -> None:
        """Drop the lock and remove the lock file, unless another reader still holds it: a
        run directory at rest holds no ``.lock``."""
        if self._fd is None:
            return
        if not self.shared:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
        if fcntl is not None:
            try:
                if self.shared:  # the last reader out removes it
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if self._still_the_lock_file(self._fd):
                    # Removed while held: whoever opened it meanwhile sees that it was
                    # replaced (acquire) and takes the new one.
                    os.unlink(self.run_dir / LOCK_FILE)
            except OSError:
                pass  # held by another reader, or not ours to remove: it stays
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def _still_the_lock_file(self, fd: int) -> bool:
        """Whether ``fd`` is the file at ``run_dir/.lock`` (not one removed since it was
        opened)."""
        try:
            here, held = os.stat(self.run_dir / LOCK_FILE), os.fstat(fd)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _holder_text() -> str:
    command = " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if sys.argv else "python"
    # Arguments of undecodable bytes arrive as lone surrogates, which UTF-8 cannot encode.
    command = command.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(command) > 120:
        command = command[:117] + "..."
    since = datetime.datetime.now().isoformat(timespec="seconds")
    return f"process {os.getpid()} on {socket.gethostname()} ({command}; since {since})"


def _read_holder(fd: int) -> str:
    # The holder writes its name just after taking the lock: give it a moment to appear.
    for _ in range(50):
        try:
            text = os.pread(fd, 1024, 0).decode("utf-8", "replace").strip()
        except OSError:
            break
        if text:
            return " ".join(text.split())
        time.sleep(0.01)
    return "another process (one reading it, or a run starting)"


class NotARegularFile(OSError):
    """A run's file that is a FIFO, a device or a directory: reading it could block for ever
    or never end (a FIFO, ``/dev/zero``), so it is never read."""


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISSOCK, "a socket"))


def read_regular_file(path: Path) -> bytes:
    """The bytes of ``path``, which must be a regular file (after symbolic links): a FIFO, a
    device or a directory raises :class:`NotARegularFile` without blocking or reading it
    (opened non-blocking, checked with ``fstat`` on the very file opened). Other failures
    raise OSError as ``open`` does."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotARegularFile(errno.EINVAL, f"it is {kind}, not a regular file", str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON object from ``path``, or None when it is missing, not a regular file or not
    one."""
    try:
        data = json.loads(read_regular_file(path).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None

"""The transformer layer's two autograd Functions as C++ nodes, built on first use.

`fused_blocks.norm_qkv` and `fused_blocks.proj_norm_mlp` call some thirty kernels per layer
from Python, and at small widths that Python is a visible share of a CPU training step; torch's
own layers pay none of it. ``native_layers.cpp`` holds the same two Functions as C++ autograd
nodes calling the same kernels in the same order, so the values do not change: for float
linears, and for FP8 linears whose casts the host library's kernels make (the nodes call them
directly; see `fp8.native_casts`). The FP8 linear itself (an FP8 model's readout, an
``FP8Linear``) is a node of the same file (`fp8.linear.native_linear`).

The extension is compiled against the installed torch the first time a layer asks for it
(a minute or two; a line on stderr says so, every time it is built) and cached under
``~/.cache/ipu-unit-scaling/native-layers/``, in a folder keyed by everything the binary
depends on (:func:`build_key`: the source and its header, the flags, the compiler, the torch
and the Python it links against), so two virtual environments or two checkouts each keep their
own build instead of rebuilding each other's, and a folder's build loads as it is, whatever
its sources' file times. Processes that build at once take turns (a lock
file in the folder). Where it cannot be built (no C++ compiler or no ``ninja``) or where
``IPU_UNIT_SCALING_NATIVE_LAYERS=0``, the layers keep their Python Functions, and
:func:`status` says why.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Iterator, List, Optional, Sequence, Union

import torch

__all__ = ["OFF_ENV", "SOURCE", "HEADERS", "switched_off", "build_key", "build_directory", "module",
           "usable", "node_casts", "status"]

OFF_ENV = "IPU_UNIT_SCALING_NATIVE_LAYERS"
SOURCE = Path(__file__).with_name("native_layers.cpp")
# The headers the source includes, by name, next to it.
HEADERS = ("native_casts.hpp",)
# The file torch.utils.cpp_extension holds while it builds in a folder.
TORCH_BUILD_LOCK = "lock"

_loaded: Optional[ModuleType] = None
_failure: Optional[str] = None


_NAME = "ius_native_layers"
_CFLAGS = ["-O2"]


def build_key() -> str:
    """A digest of what the binary depends on: the source (its text and its path, which the
    build file names), the flags, the compiler, and the torch and the Python it compiles
    against (versions, install paths, ABI)."""
    compiler = shutil.which(os.environ.get("CXX", "c++")) or ""
    stat = os.stat(compiler) if compiler else None
    parts: List[Union[bytes, str]] = [
        SOURCE.read_bytes(), *(_read(header) for header in _headers()),
        str(SOURCE.resolve()), " ".join(_CFLAGS),
        os.path.realpath(compiler) if compiler else "", f"{stat.st_size}:{stat.st_mtime_ns}"
        if stat else "", torch.__version__, str(getattr(torch.version, "git_version", "")),
        str(Path(torch.__file__).resolve().parent),
        str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")), sys.version,
        str(sysconfig.get_paths().get("include")), str(sysconfig.get_config_var("EXT_SUFFIX")),
    ]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode("utf-8", "replace"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _headers() -> List[Path]:
    return [SOURCE.with_name(name) for name in HEADERS]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # (a missing header fails the build, which says so)
        return b""


def build_directory() -> Path:
    """Where the extension is built: one folder per :func:`build_key`, named with the torch and
    Python versions for a reader."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = torch.__version__.replace("+", "-")
    python = sysconfig.get_config_var("py_version_nodot") or "".join(map(str, sys.version_info[:2]))
    return cache / "ipu-unit-scaling" / "native-layers" / \
        f"torch-{version}-py{python}-{build_key()}"


def _library(directory: Path) -> Path:
    return directory / f"{_NAME}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"


def _load_built(library: Path) -> Optional[ModuleType]:
    """The extension built at ``library``, loaded as it is, or None where it cannot be (a
    build cut short). Not through torch's builder: ninja would rebuild it for a source file
    newer than it, as a checkout, a stash or a copy leaves every file it touches, though the
    folder's key says that the sources' content is the one built."""
    try:
        spec = importlib.util.spec_from_file_location(_NAME, str(library))
        if spec is None or spec.loader is None:
            return None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded
    except (ImportError, OSError):
        return None


@contextlib.contextmanager
def _build_lock(directory: Path) -> Iterator[bool]:
    """Holds ``directory``'s lock file: one process builds, the others wait, then load what it
    built. Yields whether the lock is held: without ``fcntl``, torch's own lock around the
    compile is all there is."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield False
        return
    with open(directory / "build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            sys.stderr.write(f"ipu-unit-scaling: waiting for another process building the C++ "
                             f"transformer-layer nodes in {directory}\n")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def switched_off() -> bool:
    """Whether `OFF_ENV` switches the C++ form off."""
    return os.environ.get(OFF_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def _put_ninja_on_path() -> None:
    """torch looks for ``ninja`` on PATH; the ``ninja`` package installs it next to the
    interpreter, off PATH where a virtual environment's python runs without activation."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([str(ninja.BIN_DIR), os.environ.get("PATH", "")])


def module() -> Optional[ModuleType]:
    """The compiled extension (built now if it is not yet), or None where it is off or cannot
    be built; a failed build is not retried in the same process."""
    global _loaded, _failure
    if switched_off():
        return None
    if _loaded is not None or _failure is not None:
        return _loaded
    try:
        directory = build_directory()
        _put_ninja_on_path()
        directory.mkdir(parents=True, exist_ok=True)
        # Only a build takes the lock: processes that load a built library (the ranks of a
        # distributed run) neither wait for each other nor say so.
        library = _library(directory)
        _loaded = _load_built(library) if library.is_file() else None
        if _loaded is not None:
            return _loaded
        with _build_lock(directory) as held:
            # (built while this process waited for the lock, or one that does not load)
            _loaded = _load_built(library) if library.is_file() else None
            if _loaded is not None:
                return _loaded
            if library.is_file():
                library.unlink()
            if held:
                # torch's builder takes a lock of its own, a file that a build killed midway
                # leaves behind and every later build then waits for forever; holding ours, no
                # other build can be running here.
                (directory / TORCH_BUILD_LOCK).unlink(missing_ok=True)
            sys.stderr.write(
                f"ipu-unit-scaling: building the C++ transformer-layer nodes for torch "
                f"{torch.__version__} in {directory} (a minute or two)\n")
            # torch's extension builder prints about CUDA on import in a CUDA build of torch on
            # a machine without a GPU (torch 2.0): noise for a CPU extension, and a run's
            # stderr is the user's. A failed build's output is in the exception, kept below.
            with contextlib.redirect_stderr(io.StringIO()):
                from torch.utils import cpp_extension

                _loaded = cpp_extension.load(
                    name=_NAME, sources=[str(SOURCE)], build_directory=str(directory),
                    extra_cflags=list(_CFLAGS), verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: Python Functions
        lines = str(error).strip().splitlines()
        _failure = f"{type(error).__name__}: {lines[-1] if lines else ''}"
        return None
    return _loaded


_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)


def usable() -> Optional[ModuleType]:
    """:func:`module`, or None also under a functorch transform (which C++ nodes do not
    support)."""
    if _transforms_active is None or _transforms_active():
        return None
    return module()


def node_casts(quantisers: Sequence[Optional[object]]) -> Optional[List[List[float]]]:
    """The FP8 casts of a layer Function's linears as the C++ nodes take them: three per
    linear (input, weight, output gradient; see `fp8.native_casts`), empty for a float
    linear (a None quantiser); None where a quantiser's casts cannot be made there (its
    ``native`` is None)."""
    casts: List[List[float]] = []
    for quantiser in quantisers:
        native: Optional[Sequence[List[float]]] = (
            ([], [], []) if quantiser is None else getattr(quantiser, "native", None))
        if native is None:
            return None
        casts.extend(native)
    return casts


def status() -> str:
    """One line: whether the layers run as C++ nodes, and if not, why."""
    if switched_off():
        return f"off ({OFF_ENV}=0): the layers run as Python autograd Functions"
    if module() is not None:
        return f"on: the layers run as C++ autograd nodes (built in {build_directory()})"
    return f"unavailable ({_failure}): the layers run as Python autograd Functions"

"""The benchmark process's heap: glibc's, kept whole between steps.

By default glibc gives freed memory at the top of its heap back to the system once more than
a threshold is free, and serves large allocations with fresh mappings; the next step writes
those pages again and takes a page fault for each. How many a step takes depends on the order
in which it happens to free its tensors, not on which ops it runs, and they were most of the
step-to-step spread of the step times (docs/guide/benchmarks.md, "The heap kept").

:func:`keep_heap` turns glibc's trimming off and fixes its mmap threshold, in this process
only, as a long-running trainer with a caching allocator (jemalloc, tcmalloc) would see its
heap. ``python -m benchmarks --heap default`` leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import platform
from typing import Optional

KEPT = "kept"
DEFAULT = "default"
HEAPS = (KEPT, DEFAULT)

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit systems: allocations above it are still mapped
# afresh (the cast rows' 64 MiB tensors).
_MMAP_THRESHOLD = 32 << 20
_NEVER = 2**31 - 1


def keep_heap() -> Optional[str]:
    """Turn off glibc's heap trimming and fix its mmap threshold at 32 MiB for this process;
    a sentence saying so, or None where the C library is not glibc or refuses."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_TRIM_THRESHOLD, _NEVER) != 1 or mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) != 1:
        return None
    return ("glibc's heap kept between steps (mallopt: no trimming, allocations up to 32 MiB "
            "from the heap), so that page faults of memory given back to the system between "
            "steps do not set the ratios; `--heap default` keeps glibc's defaults")


def set_heap(heap: str) -> str:
    """Set this process's heap to ``heap`` (one of :data:`HEAPS`); a sentence for the
    report."""
    if heap not in HEAPS:
        raise ValueError(f"heap must be one of {', '.join(HEAPS)}; got {heap!r}")
    if heap == KEPT:
        kept = keep_heap()
        if kept is not None:
            return kept
        return "the C library's defaults (the heap can be kept on glibc only)"
    return ("the C library's defaults (`--heap default`): glibc gives freed heap back to the "
            "system between steps")

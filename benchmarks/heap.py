"""The benchmark process's heap: glibc's, kept whole between steps.

By default glibc gives freed memory at the top of its heap back to the system once more than
a threshold is free, and serves large allocations with fresh mappings; the next step writes
those pages again and takes a page fault for each. How many a step takes depends on the order
in which it happens to free its tensors as much as on which ops it runs, and a step's time
rises with its count (docs/guide/benchmarks.md, "The heap kept between steps").

:func:`keep_heap` turns glibc's trimming off and fixes its mmap threshold, in this process
only, as a long-running trainer with a caching allocator (jemalloc, tcmalloc) would see its
heap. ``python -m benchmarks --heap default`` leaves glibc's defaults.

``python -m benchmarks.heap`` measures what the heap does to the steps: each heap in a fresh
process, the FP32, `static` and `mx` steps of the benchmark's GPT interleaved step by step, the
spread of their times and their page faults.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

KEPT = "kept"
DEFAULT = "default"
HEAPS = (KEPT, DEFAULT)

# mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
# glibc's largest mmap threshold on 64-bit systems: allocations above it are still mapped
# afresh (the cast rows' 64 MiB tensors).
_MMAP_THRESHOLD = 32 << 20
_NEVER = 2**31 - 1


def keep_heap(no_mappings: bool = False) -> Optional[str]:
    """Turn off glibc's heap trimming and fix its mmap threshold at 32 MiB for this process,
    and with ``no_mappings`` serve every allocation from the heap, however large; a sentence
    saying so, or None where the C library is not glibc or refuses."""
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
    if no_mappings:
        if mallopt(_M_MMAP_MAX, 0) != 1:
            return None
        return "glibc's heap kept, every allocation from it (mallopt: no trimming, no mappings)"
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


# (variant, FP8 recipe or None) of the steps `python -m benchmarks.heap` times.
_STEPS = (("fp32", None), ("static", "static"), ("mx", "mx"))


def _correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")


def _quartiles(values: Sequence[float]) -> List[float]:
    ordered = sorted(values)
    return [ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4]]


def measure_steps(steps: int, quick: bool) -> Dict[str, Dict[str, Any]]:
    """In this process, under the heap it has: per variant of :data:`_STEPS`, the median and
    quartiles of ``steps`` step times (ms, process CPU time, one torch thread), the median,
    least and most page faults of a step, and the correlation of the two."""
    import resource  # (POSIX only, as glibc's heap is)

    import torch

    from .variants import FULL_SHAPE, OURS, QUICK_SHAPE, make_batch, train_steps

    torch.set_num_threads(1)
    shape = QUICK_SHAPE if quick else FULL_SHAPE
    batch = make_batch(shape)
    made = {name: train_steps(OURS, shape, batch, recipe) for name, recipe in _STEPS}
    for instances in made.values():
        for step in instances:
            step()
            step()
    times: Dict[str, List[float]] = {name: [] for name in made}
    faults: Dict[str, List[float]] = {name: [] for name in made}
    for index in range(steps):
        for name, instances in made.items():
            step = instances[index % len(instances)]
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.process_time()
            step()
            times[name].append(1e3 * (time.process_time() - start))
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {name: {"median_ms": statistics.median(times[name]),
                   "quartiles_ms": _quartiles(times[name]),
                   "faults": statistics.median(faults[name]), "least": min(faults[name]),
                   "most": max(faults[name]),
                   "correlation": _correlation(times[name], faults[name])}
            for name in made}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.heap",
        description="the spread and page faults of training steps under each heap")
    parser.add_argument("--steps", type=int, default=40, help="steps per variant (default 40)")
    parser.add_argument("--quick", action="store_true", help="tiny model: checks the harness")
    parser.add_argument("--measure", choices=HEAPS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be at least 2; got {args.steps}")
    if args.measure is not None:
        said = set_heap(args.measure)
        print(json.dumps({"heap": said, "steps": measure_steps(args.steps, args.quick)}))
        return 0
    print("| heap | step | ms: median (quartiles) | faults a step: median (least-most) | "
          "correlation of time and faults |")
    print("|---|---|---|---|---|")
    for heap in HEAPS:
        # (each heap in a process of its own: mallopt cannot be undone)
        command = [sys.executable, "-m", "benchmarks.heap", "--measure", heap,
                   "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        for name, got in json.loads(out.splitlines()[-1])["steps"].items():
            low, high = got["quartiles_ms"]
            print(f"| {heap} | {name} | {got['median_ms']:.1f} ({low:.1f}-{high:.1f}) | "
                  f"{got['faults']:.0f} ({got['least']:.0f}-{got['most']:.0f}) | "
                  f"{got['correlation']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

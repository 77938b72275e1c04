"""Amax + cast to F143 throughput on the CPU: fused host path vs torch eager vs unit-scaling.

    python -m benchmarks.cast_throughput [--n ELEMENTS] [--min-run-time SECONDS] [--rounds N]
                                         [--reuse-memory]

Prints millions of elements per second (medians over interleaved rounds) for 16M float32
elements by default, with each row's ratio to the torch-eager composition.
"""
from __future__ import annotations

import argparse
import functools
from typing import Callable, Dict, List, Optional

import torch

from ipu_unit_scaling.fp8 import F143, cast_to_fp8, cast_to_fp8_reference
from ipu_unit_scaling.fp8 import host_library as _host

from .heap import keep_heap
from .measure import time_interleaved

EAGER = "torch eager (abs, max, log2, mul, clamp, cast)"
FUSED = "fused host (cast_to_fp8)"


def torch_eager_amax_cast(x: torch.Tensor) -> torch.Tensor:
    """The plain composition a user would write with torch ops."""
    amax = x.abs().max()
    scale = torch.clamp(torch.floor(torch.log2(F143.max / amax)), -31, 31)
    scaled = torch.clamp(x * torch.exp2(scale), -F143.max, F143.max)
    return scaled.to(torch.float8_e4m3fnuz)


def _candidates() -> Dict[str, Optional[Callable[[torch.Tensor], object]]]:
    candidates: Dict[str, Optional[Callable[[torch.Tensor], object]]] = {}
    candidates[FUSED] = (lambda x: cast_to_fp8(x, F143)) if _host.fused_cast_available() else None
    candidates[EAGER] = torch_eager_amax_cast if hasattr(torch, "float8_e4m3fnuz") else None
    candidates["torch reference (cast_to_fp8_reference)"] = lambda x: cast_to_fp8_reference(x, F143)
    try:
        from unit_scaling.formats import FPFormat

        quantise = FPFormat(4, 3).quantise
        candidates["unit-scaling FPFormat(4, 3).quantise (no amax, float out)"] = quantise
    except ImportError:
        candidates["unit-scaling FPFormat(4, 3).quantise"] = None
    return candidates


def _why_skipped(name: str) -> str:
    if name == FUSED:
        return _host.fast_path_status()
    if name == EAGER:
        return "this torch has no float8_e4m3fnuz"
    return "unit-scaling is not installed"


def run(n: int = 16 * 2**20, min_run_time: float = 1.0, rounds: int = 5) -> List[dict]:
    """One dict per implementation: name, median_s, melem_per_s, ratio_to_eager, note.

    The implementations are timed interleaved, round by round (wall clock), and each ratio to
    torch eager is the median of the per-round ratios: a slow spell of the machine (a core
    taken, the memory bandwidth shared) falls on both sides of a ratio alike."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    candidates = _candidates()
    steps = {name: functools.partial(function, x)
             for name, function in candidates.items() if function is not None}
    timings = time_interleaved(steps, rounds, min_run_time, warmup=1, clock="wall")
    rows: List[dict] = []
    for name, function in candidates.items():
        if function is None:
            rows.append({"name": name, "median_s": None, "melem_per_s": None,
                         "ratio_to_eager": None, "note": f"skipped: {_why_skipped(name)}"})
            continue
        median = timings.median_ms(name) / 1e3
        rows.append({"name": name, "median_s": median, "melem_per_s": n / median / 1e6,
                     "ratio_to_eager": timings.ratio(EAGER, name) if EAGER in steps else None,
                     "note": ""})
    return rows


def format_table(rows: List[dict], n: int) -> str:
    lines = [f"amax + cast to F143, {n / 2**20:g}M float32 elements, "
             f"{torch.get_num_threads()} threads",
             f"{'implementation':<62} {'Melem/s':>9} {'ms':>8} {'x eager':>8}"]
    for row in rows:
        if row["melem_per_s"] is None:
            lines.append(f"{row['name']:<62} {row['note']}")
            continue
        ratio = f"{row['ratio_to_eager']:.1f}" if row["ratio_to_eager"] else "-"
        lines.append(f"{row['name']:<62} {row['melem_per_s']:>9.0f} "
                     f"{row['median_s'] * 1e3:>8.2f} {ratio:>8}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16 * 2**20)
    parser.add_argument("--min-run-time", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reuse-memory", action="store_true",
                        help="serve every allocation from glibc's heap and keep it, so that "
                             "torch eager's 64 MiB temporaries reuse memory instead of taking "
                             "fresh pages at every call")
    args = parser.parse_args()
    if args.reuse_memory:
        said = keep_heap(no_mappings=True)
        if said is None:
            parser.error("--reuse-memory needs glibc")
        print(said)
    print(format_table(run(args.n, args.min_run_time, args.rounds), args.n))


if __name__ == "__main__":
    main()

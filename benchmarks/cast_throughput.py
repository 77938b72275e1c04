"""Amax + cast to F143 throughput on the CPU: fused host path vs torch eager vs unit-scaling.

    python -m benchmarks.cast_throughput [--n ELEMENTS] [--min-run-time SECONDS]

Prints millions of elements per second (medians from ``torch.utils.benchmark``) for 16M
float32 elements by default, with each row's ratio to the torch-eager composition.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional

import torch
from torch.utils import benchmark

from ipu_unit_scaling.fp8 import F143, cast_to_fp8, cast_to_fp8_reference
from ipu_unit_scaling.fp8 import host_library as _host

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


def run(n: int = 16 * 2**20, min_run_time: float = 1.0) -> List[dict]:
    """One dict per implementation: name, median_s, melem_per_s, ratio_to_eager, note."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    rows: List[dict] = []
    for name, function in _candidates().items():
        if function is None:
            rows.append({"name": name, "median_s": None, "melem_per_s": None,
                         "ratio_to_eager": None, "note": f"skipped: {_why_skipped(name)}"})
            continue
        timer = benchmark.Timer(stmt="f(x)", globals={"f": function, "x": x},
                                num_threads=torch.get_num_threads())
        median = timer.blocked_autorange(min_run_time=min_run_time).median
        rows.append({"name": name, "median_s": median, "melem_per_s": n / median / 1e6,
                     "ratio_to_eager": None, "note": ""})
    eager = next((r["melem_per_s"] for r in rows if r["name"] == EAGER), None)
    for row in rows:
        if eager and row["melem_per_s"]:
            row["ratio_to_eager"] = row["melem_per_s"] / eager
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
    parser.add_argument("--min-run-time", type=float, default=1.0)
    args = parser.parse_args()
    print(format_table(run(args.n, args.min_run_time), args.n))


if __name__ == "__main__":
    main()

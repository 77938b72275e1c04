"""Check the host fast path's FP8 rounding against the vertex code on every float32 pattern.

    python scripts/fp8_fast_path_sweep.py [--scales 0 -31 31 -3 5]

For each scale, all 2**32 float32 bit patterns go through the fast path's portable loops and
(where the CPU has them) its AVX2 and AVX-512 kernels, to codes and to values, in F143 and F152
with both overflow policies, and are compared with the vertex functions
(`codelets/fp8_arith.hpp`).
Minutes per scale; the test suite runs a strided subset of the same check.
"""
from __future__ import annotations

import argparse
import sys
import time

from ipu_unit_scaling.fp8 import host_library as _host


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[0, -31, 31, -3, 5])
    args = parser.parse_args()
    slices = 64
    total = 0
    for scale in args.scales:
        start = time.perf_counter()
        mismatches = 0
        for part in range(slices):
            mismatches += _host.fast_selftest(part << 26, 1, 1 << 26, scale)
        total += mismatches
        print(f"scale 2**{scale}: {mismatches} mismatches in 2**32 patterns "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())

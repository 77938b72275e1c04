"""The host cast kernels against the memory bound, measured in one run.

    python -m benchmarks.roofline [--n ELEMENTS] [--rounds N] [--min-run-time SECONDS]

Every kernel streams a float32 tensor too large for the caches (16M elements by default). Its
bound is the copy bandwidth measured alongside it (torch's `copy_`, which reads 4 bytes and
writes 4 per element), divided by the bytes the kernel must move per element: 4 for the amax
(read), 5 for a cast to FP8 codes (read 4, write 1), 8 for a quantise to float32 values. Each
round times the copy and every kernel in turn (wall clock: the kernels use several threads),
and a kernel's fraction of its bound is taken within the round; the table gives the median and
quartiles over rounds. Also measured: the AVX-512 and AVX2 kernels and the portable loops, and the
fused amax + cast at several block sizes (the block is cast from cache while the next streams
in). The block forms of the grouped recipes (one scale per 1x128 tile, 128x128 block, MX's
32-element block with its E8M0 scale, and the column tiles of a transposed operand) round to
float32 values as those recipes do, on the tensor viewed as a matrix of 4096 columns: 8 bytes
per element, 12 for both tile casts of an operand from one read.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .measure import time_interleaved

COPY = "copy (torch copy_)"
AMAX = "amax"
CAST = "cast to F143 codes, given scale"
AMAX_CAST = "amax + cast to F143 codes"
QUANTISE = "quantise to F143 values, given scale"
AMAX_QUANTISE = "amax + quantise to F143 values"

# The grouped recipes' block forms: (kernel, group rows, group cols, MX). The MX forms round
# to E4M3FN as the "mx" recipe does (on the F143 grid at half scale), the others to F143.
BLOCK_FORMS = (
    ("amax + quantise, 1x128 tiles", 1, 128, False),
    ("amax + quantise, 128x128 blocks", 128, 128, False),
    ("amax + quantise, 128x1 column tiles", 128, 1, False),
    ("MX amax + quantise, 1x32 blocks (E8M0)", 1, 32, True),
    ("MX amax + quantise, 32x1 column blocks (E8M0)", 32, 1, True),
)
PAIR = "MX amax + quantise, 1x32 and 32x1 blocks from one read"
BLOCK_COLUMNS = 4096

# Bytes each kernel must move per element.
BYTES = {COPY: 8, AMAX: 4, CAST: 5, AMAX_CAST: 5, QUANTISE: 8, AMAX_QUANTISE: 8, PAIR: 12,
         **{form[0]: 8 for form in BLOCK_FORMS}}


@dataclass
class RooflineRow:
    kernel: str
    threads: int
    variant: str  # "AVX2", "portable", "block 32768", ...
    melem_per_s: float
    gb_per_s: float
    fraction: float  # of the copy bound, median over rounds
    spread: tuple  # quartiles of the fraction

    def cells(self) -> List[str]:
        return [self.kernel, str(self.threads), self.variant, f"{self.melem_per_s:.0f}",
                f"{self.gb_per_s:.1f}", f"{self.fraction:.2f}",
                f"{self.spread[0]:.2f}-{self.spread[1]:.2f}"]


HEADER = ["kernel", "threads", "variant", "Melem/s", "GB/s moved", "of copy bound",
          "quartiles"]


def available() -> Optional[str]:
    """None when the host library is there, else why the roofline cannot be measured."""
    from ipu_unit_scaling.fp8 import host_library as _host

    return None if _host.fused_cast_available() else _host.fast_path_status()


def _kernels(x: torch.Tensor) -> Dict[str, Callable[[], object]]:
    from ipu_unit_scaling.fp8 import host_library as _host

    # Outputs allocated once: the kernels are measured, not the allocator (a fresh 64 MiB
    # buffer is mapped page by page on first touch, which costs more than the kernel).
    values = torch.empty_like(x)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    matrix = x.view(-1, math.gcd(x.numel(), BLOCK_COLUMNS))
    matrix_values = values.view(matrix.shape)

    def block_form(group_rows: int, group_cols: int, mx: bool) -> Callable[[], object]:
        # MX rounds to E4M3FN: max 448, emax 8, on the F143 grid at half scale.
        rule, fmt_max, emax, step = ("mx_floor", 448.0, 8, 1) if mx else ("amax", 240.0, 0, 0)
        return lambda: _host.group_quantise(matrix, group_rows, group_cols, "F143", rule,
                                            fmt_max, emax, 0, step, out=matrix_values)

    blocks = {name: block_form(rows, cols, mx) for name, rows, cols, mx in BLOCK_FORMS}
    pair_out = (matrix_values, torch.empty_like(matrix))
    blocks[PAIR] = lambda: _host.group_quantise_pair(matrix, 32, "F143", "mx_floor", 448.0, 8, 0,
                                                     1, out=pair_out)
    return {
        COPY: lambda: values.copy_(x),
        AMAX: lambda: _host.fused_amax(x),
        CAST: lambda: _host.fused_cast_to_fp8(x, "F143", 0, 0, True, out=codes),
        AMAX_CAST: lambda: _host.fused_cast_to_fp8(x, "F143", None, 0, True, out=codes),
        QUANTISE: lambda: _host.quantise_float32(x, "F143", 0, 0, True, out=values),
        AMAX_QUANTISE: lambda: _host.quantise_float32(x, "F143", None, 0, True, out=values),
        **blocks,
    }


def _with_tuning(step: Callable[[], object], block: int = -1,
                 simd: int = -1) -> Callable[[], object]:
    from ipu_unit_scaling.fp8 import host_library as _host

    def tuned() -> object:
        _host.fused_tuning(block, simd)
        try:
            return step()
        finally:
            _host.fused_tuning(_DEFAULT_BLOCK, _WIDEST)

    return tuned


_DEFAULT_BLOCK = 1 << 15
# The host library's SIMD levels (fused_tuning's simd): its default allows the widest.
_SIMD_NAMES = {0: "portable", 1: "AVX2", 2: "AVX-512"}
_WIDEST = 2


def _rows(steps: Dict[str, Callable[[], object]], kernel_of: Dict[str, str],
          variant_of: Dict[str, str], threads: int, n: int, rounds: int,
          min_run_time: float) -> List[RooflineRow]:
    timings = time_interleaved(steps, rounds, min_run_time, warmup=1, clock="wall")
    rows = []
    for name in steps:
        kernel = kernel_of[name]
        bytes_per_element = BYTES[kernel]
        fractions = sorted(bytes_per_element / BYTES[COPY] * r
                           for r in timings.ratios(COPY, name))
        quartiles = (statistics.quantiles(fractions, n=4, method="inclusive")
                     if len(fractions) > 1 else [fractions[0]] * 3)
        seconds = timings.median_ms(name) / 1e3
        rows.append(RooflineRow(
            kernel, threads, variant_of[name], n / seconds / 1e6,
            n * bytes_per_element / seconds / 1e9, statistics.median(fractions),
            (quartiles[0], quartiles[2])))
    return rows


def measure(n: int = 16 << 20, threads: Sequence[int] = (), rounds: int = 7,
            min_run_time: float = 0.2, blocks: Sequence[int] = (1 << 13, 1 << 14, 1 << 15,
                                                                  1 << 16, 1 << 17, 1 << 18),
            ) -> List[RooflineRow]:
    """Every kernel at each thread count (default 1 and all cores), with the widest SIMD
    kernels the CPU has (AVX-512 or AVX2), the narrower ones and the portable loops, and the
    amax + cast at each block size on all cores. Needs the host library."""
    from ipu_unit_scaling.fp8 import host_library as _host

    threads = list(threads) or sorted({1, os.cpu_count() or 1})
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    simd = _host.fused_tuning(-1, -1)
    saved_threads = torch.get_num_threads()
    rows: List[RooflineRow] = []
    try:
        for count in threads:
            torch.set_num_threads(count)
            kernels = _kernels(x)
            steps: Dict[str, Callable[[], object]] = {}
            kernel_of: Dict[str, str] = {}
            variant_of: Dict[str, str] = {}
            for kernel, step in kernels.items():
                steps[kernel] = step
                kernel_of[kernel] = kernel
                variant_of[kernel] = _SIMD_NAMES[simd] if kernel != COPY else "-"
                if kernel == COPY:
                    continue
                for level in range(simd - 1, -1, -1):  # the narrower kernels, side by side
                    name = f"{kernel} {_SIMD_NAMES[level]}"
                    steps[name] = _with_tuning(step, simd=level)
                    kernel_of[name], variant_of[name] = kernel, _SIMD_NAMES[level]
            if count == threads[-1]:
                for block in blocks:
                    name = f"{AMAX_CAST} block {block}"
                    steps[name] = _with_tuning(kernels[AMAX_CAST], block=block)
                    kernel_of[name], variant_of[name] = AMAX_CAST, f"block {block}"
            rows += _rows(steps, kernel_of, variant_of, count, n, rounds, min_run_time)
    finally:
        torch.set_num_threads(saved_threads)
        _host.fused_tuning(_DEFAULT_BLOCK, _WIDEST)
    return rows


def format_table(rows: List[RooflineRow]) -> str:
    cells = [HEADER] + [row.cells() for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
                     for line in cells)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.roofline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16 << 20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--min-run-time", type=float, default=0.2)
    args = parser.parse_args(argv)
    why = available()
    if why is not None:
        print(f"roofline skipped: {why}")
        return 0
    print(format_table(measure(args.n, rounds=args.rounds, min_run_time=args.min_run_time)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

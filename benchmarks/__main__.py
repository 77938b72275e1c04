"""`python -m benchmarks`: run every benchmark, print the table, write docs/BENCHMARKS.md."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from .heap import HEAPS, KEPT
from .report import command_line, markdown, text_table
from .suite import Settings, run_suite
from .variants import FULL_SHAPE, QUICK_SHAPE, SECOND_SHAPE, SWEEP_SHAPE, SWEEP_WIDTHS

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, few rounds: checks the harness, not the numbers")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile rows (compiling takes minutes on CPU)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved timing rounds per comparison (default 25, quick 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: stable ratios on a shared machine)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default=None,
                        help="time steps by the process's CPU time (default with one thread: "
                             "other programs on the machine do not count) or by wall time "
                             "(default with more threads)")
    parser.add_argument("--heap", choices=HEAPS, default=KEPT,
                        help="kept (default: glibc's heap trimming off in this process, so that "
                             "page faults of memory given back between steps do not set the "
                             "ratios) or default (glibc's defaults)")
    parser.add_argument("--output", type=Path, default=None,
                        help=f"markdown report path (default {DEFAULT_OUTPUT}; quick: none)")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    quick = args.quick
    settings = Settings(
        shape=QUICK_SHAPE if quick else FULL_SHAPE,
        rounds=args.rounds or (2 if quick else 25),
        min_run_time=0.05 if quick else 0.25,
        threads=args.threads,
        compile=not args.no_compile,
        clock=args.clock or ("cpu" if args.threads == 1 else "wall"),
        cast_elements=1 << 12 if quick else 16 << 20,
        second_shape=QUICK_SHAPE if quick else SECOND_SHAPE,
        sweep_widths=(16, 32) if quick else SWEEP_WIDTHS,
        sweep_shape=QUICK_SHAPE if quick else SWEEP_SHAPE,
        sweep_rounds=2 if quick else 7,
        heap=args.heap,
    )
    results = run_suite(settings, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(text_table(results))
    output = args.output if args.output is not None else (None if quick else DEFAULT_OUTPUT)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(markdown(results, settings, command_line()))
        print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

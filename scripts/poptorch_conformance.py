"""Run PopTorch's own test files through the PopTorch stand-in and count what passes.

    python scripts/poptorch_conformance.py TESTS_DIR FILE [FILE...] [--min-fraction F]

TESTS_DIR is a copy of graphcore/poptorch's ``tests/`` directory (its ``conftest.py`` and
``helpers.py`` included); each FILE (e.g. ``options_test.py``) runs in it, unchanged, as
``ipu-unit-scaling emulate -m pytest --no-hw-tests -q FILE`` with a per-file timeout. Prints a
table of passed / failed / errors / skipped per file and the fraction of the tests that ran
(passed + failed + errors) that passed; a file that cannot be collected counts as one error,
and a file that times out counts its unfinished tests as failed. Tests that check PopTorch's
log output are left out (``scripts/poptorch_log_filter.py``) unless ``--with-log-tests``.
Exit status 1 if the fraction is below ``--min-fraction``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
_PROGRESS = re.compile(r"^[.FEsxX]+(\s+\[\s*\d+%\])?$")


def _command() -> List[str]:
    found = shutil.which("ipu-unit-scaling")
    if found:
        return [found, "emulate"]
    return [sys.executable, "-m", "ipu_unit_scaling.apps.emulate"]


def run_file(tests: Path, name: str, timeout: float, log_tests: bool = False
             ) -> Dict[str, int]:
    command = _command() + ["-m", "pytest", "--no-hw-tests", "-q", "-p", "no:cacheprovider",
                            "--tb=no", "-o", "addopts=", name]
    env = dict(os.environ)
    if not log_tests:
        command[-1:-1] = ["-p", "poptorch_log_filter"]
        here = str(Path(__file__).resolve().parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "timeout": 0}
    try:
        done = subprocess.run(command, cwd=tests, capture_output=True, text=True,
                              timeout=timeout, env=env)
        output = done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        raw = expired.stdout or b""
        output = raw.decode() if isinstance(raw, bytes) else raw
        counts["timeout"] = 1
        for line in output.splitlines():
            if _PROGRESS.match(line.strip()):
                marks = line.split()[0]
                counts["passed"] += marks.count(".")
                counts["failed"] += marks.count("F")
                counts["errors"] += marks.count("E")
                counts["skipped"] += marks.count("s")
        counts["failed"] += 1  # the test that was running
        return counts
    summary = [line for line in output.splitlines() if _COUNT.search(line)]
    if summary:
        for number, kind in _COUNT.findall(summary[-1]):
            key = "errors" if kind.startswith("error") else kind
            if key in counts:
                counts[key] += int(number)
    if not summary or "error" in output.splitlines()[-1] and counts["passed"] + counts[
            "failed"] == 0 and counts["errors"] == 0:
        counts["errors"] = max(counts["errors"], 1)
    return counts


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tests", type=Path, help="a copy of poptorch's tests/ directory")
    parser.add_argument("files", nargs="+", help="test files, relative to TESTS")
    parser.add_argument("--min-fraction", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per file")
    parser.add_argument("--with-log-tests", action="store_true",
                        help="also run the tests that check PopTorch's log output")
    args = parser.parse_args(argv)
    totals = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    print(f"{'file':34} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8} {'seconds':>8}")
    for name in args.files:
        start = time.time()
        counts = run_file(args.tests, name, args.timeout, args.with_log_tests)
        for key in totals:
            totals[key] += counts[key]
        note = " (timed out)" if counts["timeout"] else ""
        print(f"{name:34} {counts['passed']:7d} {counts['failed']:7d} {counts['errors']:7d} "
              f"{counts['skipped']:8d} {time.time() - start:8.0f}{note}", flush=True)
    ran = totals["passed"] + totals["failed"] + totals["errors"]
    fraction = totals["passed"] / ran if ran else 0.0
    print(f"{'total':34} {totals['passed']:7d} {totals['failed']:7d} {totals['errors']:7d} "
          f"{totals['skipped']:8d}")
    print(f"pass fraction: {totals['passed']}/{ran} = {fraction:.3f}")
    return 1 if fraction < args.min_fraction else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run unit-scaling 0.3.5's own test suite against ipu_unit_scaling.

    python scripts/unit_scaling_conformance.py [--wheel PATH] [--keep DIR] [--rules NAME]
                                               [-- PYTEST_ARGS...]

The tests ship inside the library's wheel (``unit_scaling/tests/``). This script fetches the wheel
with ``pip download`` (or takes ``--wheel``), extracts only the tests into a temporary package,
points every import of the library at this package, and runs pytest there. Nothing of the
library's is kept in this repository. It prints the failing tests and one closing line:

    unit-scaling 0.3.5 conformance: N of its M tests pass here (N fail, N skipped)

Import mapping (names only, no code of the library is used):
- ``import unit_scaling`` and ``unit_scaling.X`` become ``ipu_unit_scaling`` and
  ``ipu_unit_scaling.X``;
- relative imports that leave the tests package are made absolute in the same way;
- the library's private ``_modules`` is our package root, which re-exports the modules (``uu``).

``--rules unit-scaling`` runs every test inside ``ipu_unit_scaling.rules("unit-scaling")``
(an autouse fixture added to the tests' conftest): the library's tests of its own rules then
hold here too.

Tests that need the network (Hugging Face tokenizers and datasets) are skipped with that reason.
Exit status: 0 when at least ``--min-passed`` tests passed (default 0), 1 otherwise.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

VERSION = "0.3.5"
LIBRARY = "unit_scaling"
OURS = "ipu_unit_scaling"
RENAMED_MODULES = {"_modules": ""}  # the library's private module -> our root

NEEDS_NETWORK = {
    "test_analysis.py": "downloads a Hugging Face tokenizer and dataset (no network in CI)",
}

_FROM_IMPORT = re.compile(r"^(\s*)from\s+(\.+)([\w.]*)\s+import\s+(.+)$")
_PLAIN_IMPORT = re.compile(rf"^(\s*)(import|from)\s+{LIBRARY}(\.[\w.]+)?\b")


def _ours(dotted: str) -> str:
    """``unit_scaling.a.b`` -> ``ipu_unit_scaling.a.b``, with private module names mapped."""
    parts = dotted.split(".")[1:]
    if parts and parts[0] in RENAMED_MODULES:
        replacement = RENAMED_MODULES[parts[0]]
        parts = ([replacement] if replacement else []) + parts[1:]
    return ".".join([OURS] + parts)


def rewrite_imports(source: str, package: str) -> str:
    """Point one test file's imports of the library at ours; ``package`` is the file's package,
    dotted from the library root (``unit_scaling.tests.core``)."""
    lines = []
    for line in source.splitlines(keepends=True):
        relative = _FROM_IMPORT.match(line)
        if relative:
            indent, dots, rest, names = relative.groups()
            base = package.split(".")
            base = base[: len(base) - (len(dots) - 1)]
            target = ".".join(base + ([rest] if rest else []))
            if not target.startswith(f"{LIBRARY}.tests"):
                line = f"{indent}from {_ours(target)} import {names}\n"
                # `from ... import _modules as uu`: the private module is our package root.
                for private in RENAMED_MODULES:
                    line = re.sub(rf"^(\s*)from {OURS} import {private} as (\w+)$",
                                  rf"\1import {OURS} as \2", line.rstrip("\n")) + "\n"
        else:
            line = _PLAIN_IMPORT.sub(
                lambda m: f"{m.group(1)}{m.group(2)} {_ours(LIBRARY + (m.group(3) or ''))}", line)
        lines.append(line)
    return "".join(lines)


RULES_FIXTURE = """

import ipu_unit_scaling as _ipu_unit_scaling


@pytest.fixture(autouse=True)
def _ipu_unit_scaling_rules():
    with _ipu_unit_scaling.rules({rules!r}):
        yield
"""


def extract_tests(wheel: Path, into: Path, rules: Optional[str] = None) -> Path:
    """Copy the wheel's ``unit_scaling/tests`` into ``into/unit_scaling_tests`` with imports
    rewritten; returns that package's directory. With ``rules``, every test runs inside
    ``ipu_unit_scaling.rules(rules)``."""
    root = into / "unit_scaling_tests"
    prefix = f"{LIBRARY}/tests/"
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.startswith(prefix) or not name.endswith(".py"):
                continue
            relative = Path(name[len(prefix):])
            package = ".".join([LIBRARY, "tests"] + list(relative.parent.parts))
            text = archive.read(name).decode("utf-8")
            if relative.name in NEEDS_NETWORK:
                text = (f"import pytest\npytest.skip({NEEDS_NETWORK[relative.name]!r}, "
                        "allow_module_level=True)\n")
            target = root / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(rewrite_imports(text, package), encoding="utf-8")
    if rules is not None:
        conftest = root / "conftest.py"
        text = conftest.read_text(encoding="utf-8") if conftest.exists() else ""
        if not re.search(r"^import pytest$", text, re.MULTILINE):
            text = "import pytest\n" + text
        conftest.write_text(text + RULES_FIXTURE.format(rules=rules), encoding="utf-8")
    return root


def download_wheel(directory: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary", ":all:", "-d", str(directory),
                    f"unit-scaling=={VERSION}"], check=True)
    wheels = sorted(directory.glob(f"unit_scaling-{VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download left no unit_scaling-{VERSION} wheel in {directory}")
    return wheels[0]


def count_outcomes(pytest_output: str) -> Dict[str, int]:
    """The counts of pytest's closing line (``3 failed, 110 passed, 1 skipped in 9.1s``)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    closing = [line for line in pytest_output.splitlines() if re.search(r"\bin [\d.]+s", line)]
    if closing:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", closing[-1]):
            counts["error" if word.startswith("error") else word] += int(number)
    return counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path,
                        help="a local unit_scaling wheel (default: pip download)")
    parser.add_argument("--keep", type=Path, help="extract the tests here and keep them")
    parser.add_argument("--min-passed", type=int, default=0,
                        help="exit 1 when fewer tests pass")
    parser.add_argument("--rules", choices=("ipu-unit-scaling", "unit-scaling"),
                        help="run every test inside ipu_unit_scaling.rules(NAME)")
    parser.add_argument("--verbose", action="store_true", help="print pytest's whole output")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="unit-scaling-conformance-") as scratch:
        work = args.keep or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        wheel = args.wheel or download_wheel(Path(scratch))
        tests = extract_tests(wheel, work, args.rules)
        command: List[str] = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "--rootdir", str(work), "-o", "addopts=", str(tests),
                              *args.pytest_args]
        result = subprocess.run(command, cwd=work, capture_output=True, text=True)
        if args.verbose:
            sys.stdout.write(result.stdout)
            sys.stderr.write(result.stderr)
        else:  # which tests fail, not the library's own summary lines
            sys.stdout.writelines(line + "\n" for line in result.stdout.splitlines()
                                  if line.startswith(("FAILED ", "ERROR ")))
    counts = count_outcomes(result.stdout)
    total = sum(counts.values())
    under = f' under rules("{args.rules}")' if args.rules else ""
    print(f"unit-scaling {VERSION} conformance{under}: {counts['passed']} of its {total} tests "
          f"pass here ({counts['failed'] + counts['error']} fail, {counts['skipped']} skipped)")
    return 0 if counts["passed"] >= args.min_passed else 1


if __name__ == "__main__":
    sys.exit(main())

"""Print the ATen ops a PopTorch source tree lowers, for ``ipu_standins/poptorch/_handlers.py``.

    python scripts/poptorch_ops.py PATH_TO_POPTORCH_CHECKOUT
    python scripts/poptorch_ops.py PATH_TO_POPTORCH_CHECKOUT --refusals

Reads every ``registerHandler(c10::aten::<op>, ...)`` under
``poptorch/source/popart_canonicalization/`` and every ``m.impl("<op>...")`` in
``poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc``.

``--refusals`` lists instead every check that stops compilation in a handler or in the
dispatcher (``ERROR``, ``ERROR_ON``, ``ERROR_ON_MSG``), with its file and function, to compare
with the hand-written ``ARGUMENT_RULES``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterator, Tuple

CANONICALIZATION = "poptorch/source/popart_canonicalization"
DISPATCHER = "poptorch/source/dispatch_tracer/RegisterAtenOverloads.cpp"


def handled_ops(root: Path) -> set:
    pattern = re.compile(r"registerHandler\(\s*c10::aten::(\w+)")
    names: set = set()
    for source in (root / CANONICALIZATION).rglob("*.cpp"):
        names.update(pattern.findall(source.read_text(encoding="utf-8")))
    return names


def dispatcher_ops(root: Path) -> set:
    source = root / "poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc"
    found = re.findall(r'm\.impl\("([\w]+)', source.read_text(encoding="utf-8"))
    return set(found) - {"item", "_local_scalar_dense"}


def refusals(root: Path) -> Iterator[Tuple[str, str, str]]:
    """(file, function, check) for every compile-stopping check."""
    function = re.compile(r"^[\w:<>\s*&]+?\b(\w+)\s*\([^;]*$")
    check = re.compile(r"\bERROR(?:_ON(?:_MSG)?)?\s*\(")
    sources = sorted((root / CANONICALIZATION).rglob("*.cpp")) + [root / DISPATCHER]
    for source in sources:
        current = "?"
        lines = source.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines):
            match = function.match(line)
            if match and not line.startswith((" ", "\t", "#", "//")):
                current = match.group(1)
            if check.search(line):
                text = " ".join(part.strip() for part in lines[number:number + 3])
                yield str(source.relative_to(root)), current, text[:160]


def main() -> None:
    root = Path(sys.argv[1])
    if "--refusals" in sys.argv[2:]:
        for path, function, text in refusals(root):
            print(f"{path}: {function}: {text}")
        return
    handled = handled_ops(root)
    print("HANDLED_OPS:", " ".join(sorted(handled)))
    print("DISPATCHER_OPS:", " ".join(sorted(dispatcher_ops(root) - handled)))


if __name__ == "__main__":
    main()

"""Print the ATen ops a PopTorch source tree lowers, for ``backends/poptorch_ops.py``.

    python scripts/poptorch_ops.py PATH_TO_POPTORCH_CHECKOUT

Reads every ``registerHandler(c10::aten::<op>, ...)`` under
``poptorch/source/popart_canonicalization/`` and every ``m.impl("<op>...")`` in
``poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path


def handled_ops(root: Path) -> set:
    pattern = re.compile(r"registerHandler\(\s*c10::aten::(\w+)")
    names: set = set()
    for source in (root / "poptorch/source/popart_canonicalization").rglob("*.cpp"):
        names.update(pattern.findall(source.read_text(encoding="utf-8")))
    return names


def dispatcher_ops(root: Path) -> set:
    source = root / "poptorch/source/dispatch_tracer/RegisterOptionalAtenOps.cpp.inc"
    found = re.findall(r'm\.impl\("([\w]+)', source.read_text(encoding="utf-8"))
    return set(found) - {"item", "_local_scalar_dense"}


def main() -> None:
    root = Path(sys.argv[1])
    handled = handled_ops(root)
    print("HANDLED_OPS:", " ".join(sorted(handled)))
    print("DISPATCHER_OPS:", " ".join(sorted(dispatcher_ops(root) - handled)))


if __name__ == "__main__":
    main()

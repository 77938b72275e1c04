"""The package's layout rules: folders name the layers, imports point down, names are unique,
no file is long without saying why."""
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Set

import ipu_unit_scaling

PACKAGE = Path(ipu_unit_scaling.__file__).parent
ROOT = PACKAGE.parent
# Bottom layer first. A module imports only from its own layer or a lower one.
LAYERS = ["ops", "modules", "fp8", "transforms", "parametrization", "models", "training",
          "analysis", "backends", "loop", "apps"]
# Public paths that repeat a name because unit-scaling's paths do (functional, core.functional).
PUBLIC_REPEATS = {"functional"}
# Stand-ins serve their modules under the real package's names (poptorch.ops, poptorch.optim).
STANDIN_PACKAGES = ("backends.poptorch_standin.",)
LONG_FILE_LINES = 600
LONG_FILE_REASON = "Over 600 lines because"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, module_level_only: bool) -> Set[str]:
    """The package modules ``name`` imports (a ``from x import y`` of a submodule counts y)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: Set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.split(".")[0] == "ipu_unit_scaling":
                target = node.module.partition(".")[2]
            else:
                continue
            submodules = [a.name for a in node.names
                          if (f"{target}.{a.name}" if target else a.name) in MODULES]
            found.update(f"{target}.{s}" if target else s for s in submodules)
            if len(submodules) < len(node.names):
                found.add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ipu_unit_scaling":
                    found.add(alias.name.partition(".")[2])
    return {m for m in found if m in MODULES and m != name}


def _layer(name: str) -> Optional[int]:
    top = name.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def test_every_folder_is_a_layer():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders - {"core"} == set(LAYERS), "a folder of the package is not in LAYERS"


def test_no_import_points_up_a_layer():
    upward = []
    for name in MODULES:
        layer = _layer(name)
        if layer is None:
            continue
        for target in _imports(name, module_level_only=False):
            target_layer = _layer(target)
            if target_layer is None:
                if not (name.startswith("apps.") and target == ""):  # apps may read __version__
                    upward.append(f"{name} -> {target or 'ipu_unit_scaling'} (a public path)")
            elif target_layer > layer:
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that point up: " + ", ".join(sorted(upward))


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    circles: List[List[str]] = []

    def visit(node: str, path: List[str], done: Set[str]) -> None:
        for target in sorted(graph[node]):
            if target in path:
                circles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target, path + [target], done)
        done.add(node)

    done: Set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    return circles


def test_no_import_circles():
    circles = _circles({name: _imports(name, module_level_only=True) for name in MODULES})
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


# Packages where an import made inside a function counts too: no module imports, even when a
# function first runs, a module that imports it back.
NO_CIRCLES_EVEN_IN_FUNCTIONS = ("backends.popxl",)


def test_no_import_circles_through_functions():
    inside = [name for name in MODULES if name.startswith(NO_CIRCLES_EVEN_IN_FUNCTIONS)]
    graph = {name: _imports(name, module_level_only=False) & set(inside) for name in inside}
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_module_names_are_unique():
    seen: Dict[str, List[str]] = {}
    for name in MODULES:
        if name and not name.startswith(STANDIN_PACKAGES):
            seen.setdefault(name.split(".")[-1], []).append(name)
    repeated = {base: names for base, names in seen.items()
                if len(names) > 1 and base not in PUBLIC_REPEATS}
    assert not repeated, f"modules that share a name: {repeated}"


def test_long_files_say_why():
    unexplained = []
    for path in MODULES.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > LONG_FILE_LINES and not any(LONG_FILE_REASON in line
                                                    for line in lines[:40]):
            unexplained.append(f"{path.relative_to(PACKAGE)} ({len(lines)} lines)")
    assert not unexplained, f"files over {LONG_FILE_LINES} lines with no reason at the top: " \
                            f"{unexplained}"


def test_help_opens_with_a_map_of_every_layer():
    doc = ipu_unit_scaling.__doc__ or ""
    map_start = doc.index("Package map")
    assert map_start < 700, "the package map is not near the top of help(ipu_unit_scaling)"
    missing = [layer for layer in LAYERS if f"    {layer}/" not in doc]
    assert not missing, f"layers missing from the package map: {missing}"


def test_documented_paths_work_in_a_fresh_interpreter():
    """The paths the README documents, imported first thing."""
    code = ("from ipu_unit_scaling.training.run_config import load_config\n"
            "from ipu_unit_scaling.fp8 import codelet_emulator\n"
            "from ipu_unit_scaling.backends.poptorch.fp8_custom_op import fp8_amax_cast\n"
            "from ipu_unit_scaling.analysis import track_scales, analyse, ScaleReporter\n"
            "from ipu_unit_scaling.backends import build_training_model, make_optimizer\n"
            "from ipu_unit_scaling.ipu import check_poptorch, ipu_tracing, trace_like_poptorch\n"
            "from ipu_unit_scaling.models import GPTConfig, build_gpt\n"
            "import ipu_unit_scaling.loop.training_loop as loop\n"
            "assert loop.__spec__.name == 'ipu_unit_scaling.loop.training_loop'\n"
            "assert codelet_emulator.__name__.endswith('fp8.codelet_emulator')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_root_scale_is_the_scale_module():
    """``uu.scale`` is unit-scaling's ``scale`` path, a module, whatever was imported first."""
    code = ("import ipu_unit_scaling as uu, types\n"
            "assert isinstance(uu.scale, types.ModuleType), uu.scale\n"
            "import ipu_unit_scaling.scale as module\n"
            "assert uu.scale is module and callable(module.scale)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# A docstring's cross-reference (:mod:`...`, :func:`~...`, :class:`title <...>`), and code that
# names a path of the package (`ipu_unit_scaling.x.y`, ``ipu_unit_scaling/x/y.py``). A path
# whose every part is one letter, as those two, is a placeholder.
REFERENCE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`(?:[^`<]*<)?~?([\w.]+)>?`")
CODE_PATH = re.compile(r"`~?(ipu_unit_scaling(?:\.\w+)+)")
FILE_PATH = re.compile(r"ipu_unit_scaling/[\w/]+\.py")
_MISSING = object()


def _names_something(dotted: str) -> bool:
    """Whether ``dotted``, a path under the package ('' for the package), names a module or an
    attribute of one (a dataclass field or an annotated class attribute counts)."""
    parts = dotted.split(".") if dotted else []
    cut = next((cut for cut in range(len(parts), -1, -1) if ".".join(parts[:cut]) in MODULES),
               None)
    if cut is None:
        return False
    value = importlib.import_module(".".join(["ipu_unit_scaling"] + parts[:cut]))
    for attribute in parts[cut:]:
        found = getattr(value, attribute, _MISSING)
        if found is _MISSING:
            return isinstance(value, type) and (
                attribute in getattr(value, "__dataclass_fields__", {})
                or attribute in getattr(value, "__annotations__", {}))
        value = found
    return True


def _reference_resolves(target: str, module: Optional[str]) -> Optional[bool]:
    """Whether a reference made in ``module`` (None: outside the package) names something;
    None for a reference to another package (``torch.nn.Linear``, ``poptorch.DataLoader``)."""
    if target.startswith("ipu_unit_scaling."):
        return _names_something(target[len("ipu_unit_scaling."):])
    if module is None:
        return None
    here = module.split(".") if module else []
    package = here if MODULES[module].name == "__init__.py" else here[:-1]
    if target.startswith("."):  # as a relative import reads it, or (one dot) in this module
        level = len(target) - len(target.lstrip("."))
        base = package[: len(package) - (level - 1)]
        candidates = [base + [target[level:]]] + ([here + [target[level:]]] if level == 1 else [])
        return any(_names_something(".".join(c)) for c in candidates)
    if "." not in target:
        return None
    first = target.split(".")[0]
    for base in (here, package, []):  # this module, its package, the package root
        if _names_something(".".join(base + [first])):
            return _names_something(".".join(base + [target]))
    return None


def _placeholder(path: str) -> bool:
    return all(len(part) == 1 for part in re.split(r"[./]", path)[1:])


def _unresolved_references() -> List[str]:
    sources = [(name, path) for name, path in sorted(MODULES.items())]
    for folder in ("tests", "scripts", "examples", "benchmarks"):
        sources += [(None, path) for path in sorted((ROOT / folder).rglob("*.py"))]
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    sources += [(None, path) for path in pages if path.exists()]
    bad = []
    for module, path in sources:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{number}"
            targets = CODE_PATH.findall(line) + re.findall(r"^::: (ipu_unit_scaling[\w.]*)", line)
            if path.suffix == ".py":
                targets += REFERENCE.findall(line)
            bad += [f"{where}: {t}" for t in targets
                    if not _placeholder(t) and _reference_resolves(t, module) is False]
            bad += [f"{where}: {p}" for p in FILE_PATH.findall(line)
                    if not _placeholder(p[:-3]) and not (ROOT / p).exists()]
    return bad


def test_every_reference_to_the_package_resolves():
    """Cross-references in docstrings, and module paths and file paths in code spans of the
    sources and docs, name a module, function, class or attribute that exists today."""
    bad = _unresolved_references()
    assert not bad, "references to paths that do not exist:\n" + "\n".join(bad)

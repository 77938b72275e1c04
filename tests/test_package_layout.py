"""The package's layout rules: folders name the layers, imports point down, names are unique,
no file is long without saying why."""
from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional, Set

import ipu_unit_scaling

PACKAGE = Path(ipu_unit_scaling.__file__).parent
ROOT = PACKAGE.parent
# Bottom layer first. A module imports only from its own layer or a lower one.
LAYERS = ["ops", "modules", "fp8", "transforms", "parametrization", "models", "training",
          "analysis", "backends", "loop", "apps"]
# Public paths that repeat a name because unit-scaling's paths do (functional and
# core.functional, utils and transforms.utils).
PUBLIC_REPEATS = {"functional", "utils"}
LONG_FILE_LINES = 600
LONG_FILE_REASON = "Over 600 lines because"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES: Dict[str, Path] = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


@functools.lru_cache(maxsize=None)
def _tree(name: str) -> ast.Module:
    return ast.parse(MODULES[name].read_text(encoding="utf-8"))


def _imports(name: str, module_level_only: bool) -> Set[str]:
    """The package modules ``name`` imports (a ``from x import y`` of a submodule counts y)."""
    path = MODULES[name]
    tree = _tree(name)
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


# An import made inside a function counts too: no module imports, even when a function first
# runs, a module that imports it back.
def test_no_import_circles_through_functions():
    graph = {}
    for name in MODULES:
        graph[name] = _imports(name, module_level_only=False)
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_module_names_are_unique():
    seen: Dict[str, List[str]] = {}
    for name in MODULES:
        if name:
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
            "from ipu_unit_scaling.fp8 import codelets_on_host\n"
            "from ipu_unit_scaling.backends.poptorch.fp8_custom_op import fp8_amax_cast\n"
            "from ipu_unit_scaling.analysis import record_scales, analyse, ScaleReporter\n"
            "from ipu_unit_scaling.backends import build_training_model, make_optimizer\n"
            "from ipu_unit_scaling.ipu import check_poptorch, ipu_tracing, trace_like_poptorch\n"
            "from ipu_unit_scaling.models import GPTConfig, build_gpt\n"
            "import ipu_unit_scaling.loop.training_loop as loop\n"
            "assert loop.__spec__.name == 'ipu_unit_scaling.loop.training_loop'\n"
            "assert codelets_on_host.__name__.endswith('fp8.codelets_on_host')\n")
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
FILE_PATH = re.compile(r"ipu_unit_scaling/[\w/]+(?:\.py|/)")
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
            targets += re.findall(r"\]\[(ipu_unit_scaling[\w.]*)\]", line)  # a docs cross-link
            if path.suffix == ".py":
                targets += REFERENCE.findall(line)
            bad += [f"{where}: {t}" for t in targets
                    if not _placeholder(t) and _reference_resolves(t, module) is False]
            bad += [f"{where}: {p}" for p in FILE_PATH.findall(line)
                    if not _placeholder(re.sub(r"(\.py|/)$", "", p)) and not (ROOT / p).exists()]
    return bad


def test_every_reference_to_the_package_resolves():
    """Cross-references in docstrings, and module paths and file paths in code spans of the
    sources and docs, name a module, function, class or attribute that exists today."""
    bad = _unresolved_references()
    assert not bad, "references to paths that do not exist:\n" + "\n".join(bad)


# ------------------------------------------------------------------ names: one path, no privates

# unit-scaling 0.3.5's public module paths, which its users import, and this package's own
# documented public paths: each re-exports names written in a layer.
PUBLIC_PATHS = {"", "functional", "core", "core.functional", "scale", "constraints", "formats",
                "parameter", "optim", "utils", "docs", "transforms.utils", "ipu"}
def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.lru_cache(maxsize=None)
def _reexports(name: str) -> Dict[str, str]:
    return _served(name)


def _package_parts(name: str) -> List[str]:
    parts = name.split(".") if name else []
    return parts if MODULES[name].name == "__init__.py" else parts[:-1]


def _import_target(name: str, node: ast.ImportFrom) -> Optional[str]:
    """The package module a ``from ... import`` in module ``name`` reads, or None."""
    if node.level:
        package = _package_parts(name)
        base = package[: len(package) - (node.level - 1)]
        return ".".join(base + (node.module.split(".") if node.module else []))
    if node.module and node.module.split(".")[0] == "ipu_unit_scaling":
        return node.module.partition(".")[2]
    return None


def _defined_names(name: str) -> Set[str]:
    """Public functions and classes written in module ``name``, and the other names it binds
    itself and lists in ``__all__``."""
    tree = _tree(name)
    listed = set(_literal_all(tree) or [])
    found: Set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith("_"):
                found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(t.id for t in targets if isinstance(t, ast.Name) and t.id in listed)
    return found


def _literal_all(tree: ast.Module) -> Optional[List[str]]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def _exported_names(name: str) -> Set[str]:
    """What ``from <module> import *`` gives."""
    listed = _literal_all(_tree(name))
    if listed is None:
        module = importlib.import_module(f"ipu_unit_scaling.{name}".rstrip("."))
        listed = list(getattr(module, "__all__", []))
    return set(listed)


def _served(name: str) -> Dict[str, str]:
    """The names module ``name`` serves from another package module, by where they come from:
    the imported names it lists in ``__all__`` (a package ``__init__`` with no ``__all__``:
    every name it imports), and everything ``import *`` brings."""
    tree = _tree(name)
    listed = _literal_all(tree)
    is_package = MODULES[name].name == "__init__.py"
    served: Dict[str, str] = {}
    nodes = list(tree.body) + [inner for node in tree.body if isinstance(node, ast.If)
                               for inner in node.body]  # `if TYPE_CHECKING:` imports too
    for node in nodes:
        if not isinstance(node, ast.ImportFrom):
            continue
        target = _import_target(name, node)
        if target is None or target not in MODULES:
            continue
        for alias in node.names:
            if alias.name == "*":
                served.update({n: target for n in _exported_names(target)})
            elif f"{target}.{alias.name}".strip(".") in MODULES or alias.name.startswith("_"):
                continue
            elif (alias.asname or alias.name) in (listed or []) or (is_package and listed is None):
                served[alias.asname or alias.name] = target
    return served


@functools.lru_cache(maxsize=None)
def _definitions() -> Dict[str, List[str]]:
    where: Dict[str, List[str]] = {}
    for name in sorted(MODULES):
        for defined in _defined_names(name):
            where.setdefault(defined, []).append(name)
    return where


def _written_in(served: str, source: str, definitions: Dict[str, List[str]]) -> Optional[str]:
    """The module that writes ``served``, followed from ``source`` through re-exports."""
    seen: Set[str] = set()
    while source not in seen:
        seen.add(source)
        if source in definitions.get(served, []):
            return source
        nxt = _reexports(source).get(served)
        if nxt is None:
            return None
        source = nxt
    return None


def _may_serve(module: str, writer: str) -> bool:
    """A name is served by the module that writes it, that module's package, the package root
    and the public paths; the stand-ins serve the namespaces they mirror."""
    if module in PUBLIC_PATHS:
        return True
    return module == ".".join(_package_parts(writer)) and module != writer


def _second_paths() -> Set[str]:
    """Names defined in more than one module, and names served by a module that may not."""
    definitions = _definitions()
    found: Set[str] = set()
    for defined, modules in definitions.items():
        if len(modules) > 1:
            found.add(f"{defined} defined in {', '.join(modules)}")
    for module in sorted(MODULES):
        for served, source in sorted(_reexports(module).items()):
            writer = _written_in(served, source, definitions)
            if writer is not None and not _may_serve(module, writer):
                found.add(f"{module} serves {served} of {writer}")
    return found


def _private_imports() -> Set[str]:
    """``importer: module.name`` for each private name a module takes from another module of
    the package: imported by name, or read as an attribute of an imported module."""
    found: Set[str] = set()
    for name in sorted(MODULES):
        tree = _tree(name)
        modules: Dict[str, str] = {}  # local name -> package module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _import_target(name, node)
                if target is None:
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}".strip(".")
                    if full in MODULES:
                        modules[alias.asname or alias.name] = full
                    elif _is_private(alias.name):
                        found.add(f"{name}: {full}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("ipu_unit_scaling.") and alias.asname:
                        modules[alias.asname] = alias.name.partition(".")[2]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and _is_private(node.attr)):
                full = f"{modules[node.value.id]}.{node.attr}"
                if full not in MODULES:
                    found.add(f"{name}: {full}")
    return found


def _imports_through_second_paths() -> Set[str]:
    """``file: module.name`` for each import, in the package, in tests/, scripts/, examples/
    and benchmarks/, and in the Python examples of docs/ and the README, of a public name from a
    module that neither writes nor may serve it."""
    definitions = _definitions()
    sources = [(name, path) for name, path in sorted(MODULES.items())]
    for folder in ("tests", "scripts", "examples", "benchmarks"):
        sources += [(None, path) for path in sorted((ROOT / folder).rglob("*.py"))]
    trees = [(module, path, _tree(module) if module is not None
              else ast.parse(path.read_text(encoding="utf-8"))) for module, path in sources]
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    for page in (p for p in pages if p.exists()):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            try:
                trees.append((None, page, ast.parse(block)))
            except SyntaxError:  # a fragment, not a program
                continue
    found: Set[str] = set()
    for module, path, tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if module is None and node.level:
                continue
            target = _import_target(module or "", node) if module is not None else (
                node.module.partition(".")[2] if node.module and
                node.module.split(".")[0] == "ipu_unit_scaling" else None)
            if target is None or target not in MODULES:
                continue
            for alias in node.names:
                if (alias.name == "*" or alias.name.startswith("_")
                        or f"{target}.{alias.name}".strip(".") in MODULES
                        or alias.name not in definitions or target in definitions[alias.name]):
                    continue
                if target in PUBLIC_PATHS:
                    continue
                writer = _written_in(alias.name, target, definitions)
                if writer is None or not _may_serve(target, writer):
                    found.add(f"{path.relative_to(ROOT)}: {target}.{alias.name}")
    return found


def _test_module_names(module: str) -> Set[str]:
    """Test module names that say they test ``module``: ``test_`` and the module's dotted path
    from any depth, underscores for dots (``test_unit_ops``, ``test_ops_unit_ops``), or the
    name of its package (a grouped test module: ``test_poptorch_standin``); any of these may go
    on with ``_`` and a topic (``test_popxl_model``)."""
    parts = [p.strip("_") for p in module.split(".")]
    names = {"test_" + "_".join(parts[i:]) for i in range(len(parts))}
    return names | ({f"test_{parts[-2]}"} if len(parts) > 1 else set())


def _untested_modules() -> Set[str]:
    stems = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    untested = set()
    for module in MODULES:
        if not module or module.endswith("__main__"):
            continue
        names = _test_module_names(module)
        if not any(s in names or any(s.startswith(n + "_") for n in names) for s in stems):
            untested.add(module)
    return untested


# Known today, each under the layer that must change: the check fails on anything not listed,
# and on a listed entry that is no longer so, so the list only shrinks.
KNOWN_SECOND_PATHS = {
    # ops layer: the fused eager forms in ops/fused_ops.py share the names of the ops they fuse
    "embedding defined in ops.fused_ops, ops.unit_ops",
    "gelu defined in ops.activation_ops, ops.fused_ops",
    "layer_norm defined in ops.fused_ops, ops.unit_ops",
    "linear defined in ops.fused_ops, ops.unit_ops",
    "matmul defined in ops.fused_ops, ops.unit_ops",
    "residual_add defined in ops.fused_ops, ops.unit_ops",
    "residual_split defined in ops.fused_ops, ops.unit_ops",
}

def test_each_public_name_is_written_once_and_served_from_one_path():
    """A public name is defined in one module and served only by that module, its package, the
    package root and the public paths (PUBLIC_PATHS); no module of the package, test, script,
    example or benchmark imports it through another module."""
    found = _second_paths()
    new = sorted(found - KNOWN_SECOND_PATHS)
    assert not new, "names written twice or served from a second path:\n" + "\n".join(new)
    fixed = sorted(KNOWN_SECOND_PATHS - found)
    assert not fixed, f"KNOWN_SECOND_PATHS lists what is no longer so (it only shrinks): {fixed}"
    through = sorted(_imports_through_second_paths())
    assert not through, "imports through a second path:\n" + "\n".join(through)


def test_no_private_name_is_taken_from_another_module():
    """What two modules share is public: no module imports another module's private name, or
    reads it as an attribute of that module."""
    found = sorted(_private_imports())
    assert not found, "private names taken from another module:\n" + "\n".join(found)


# ----------------------------------------------------------------------- a config read once


def _dataclass_sections(cls: type, seen: Set[type]) -> None:
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        for kind in [hints[field.name], *typing.get_args(hints[field.name])]:
            if isinstance(kind, type) and dataclasses.is_dataclass(kind) and kind not in seen:
                _dataclass_sections(kind, seen)


def test_the_run_config_and_its_sections_are_frozen():
    """The run config (``Config``, every dataclass section under it) and ``GPTConfig`` are
    frozen dataclasses: changed with ``dataclasses.replace``, never in place."""
    from ipu_unit_scaling.models.gpt import GPTConfig
    from ipu_unit_scaling.training.run_config import Config

    sections: Set[type] = set()
    for root in (Config, GPTConfig):
        _dataclass_sections(root, sections)
    assert len(sections) > 2, sections
    thawed = sorted(f"{c.__module__}.{c.__qualname__}" for c in sections
                    if not c.__dataclass_params__.frozen)  # type: ignore[attr-defined]
    assert not thawed, f"config dataclasses that are not frozen: {thawed}"


# --------------------------------------------------------------- a test module for each module

# Modules with no test module named after them today (see _test_module_names). A new module
# comes with its test module; one that gains a test module leaves this list.
UNTESTED_TODAY = {
    # apps layer
    "apps",
    "apps.progress",
    # loop layer
    "loop",
    "loop.run_opening",
    "loop.run_outcomes",
    # models layer
    "models",
    "models.encoder",
    "models.gpt",
    # ops layer
    "ops",
    "ops.activation_ops",
    "ops.attention_ops",
    "ops.fused_blocks",
    "ops.loss_ops",
    "ops.op_helpers",
    "ops.op_library",
    "ops.scale_constraints",
    "ops.scaling_primitive",
    "ops.softmax_moments",
    "ops.trace_switch",
    "ops.unit_ops",
    # parametrization layer
    "parametrization",
    "parametrization.mup_optimizers",
    # the public paths
    "constraints",
    "core",
    "formats",
    "parameter",
    "scale",
    # transforms layer
    "transforms",
    "transforms.compose",
    "transforms.export",
    "transforms.fx_tracing",
    "transforms.graph",
    "transforms.replacements",
    "transforms.scale_tracking",
}


def test_each_module_has_a_test_module():
    untested = _untested_modules()
    missing = sorted(untested - UNTESTED_TODAY)
    assert not missing, ("modules with no tests/**/test_<module>.py (or a test module named "
                         "after their package):\n" + "\n".join(missing))
    # The list only shrinks: a module that gained its test module leaves it.
    tested = sorted(UNTESTED_TODAY - untested)
    assert not tested, "UNTESTED_TODAY lists modules that now have a test module: " + str(tested)


def test_help_lists_each_name_of_the_package_once():
    """``help(ipu_unit_scaling)`` shows each name of ``__all__`` once: a submodule in the package
    contents, a class, function or constant as itself (``scale`` is unit-scaling's module)."""
    import pydoc

    text = pydoc.render_doc(ipu_unit_scaling, renderer=pydoc.plaintext)
    contents = text.split("PACKAGE CONTENTS", 1)[1].split("\nCLASSES", 1)
    listing, members = contents[0], contents[1]
    counts = {}
    for name in ipu_unit_scaling.__all__:
        as_member = len(re.findall(rf"^    (?:class )?{name}(?:\(| = )", members, re.M))
        as_module = len(re.findall(rf"^    {name}(?: \(package\))?$", listing, re.M))
        counts[name] = (as_module, as_member)
    wrong = {name: count for name, count in counts.items() if sum(count) != 1}
    assert not wrong, f"names help() lists other than once (as module, as member): {wrong}"
    assert counts["scale"] == (1, 0)


# Packages that bind a submodule's name to something else today (transforms layer: the function
# unit_scale and the module transforms/unit_scale.py).
NAME_CLASHES_TODAY = {"transforms.unit_scale"}


def test_no_package_binds_a_submodule_name_to_something_else():
    """``import ipu_unit_scaling.x.y as m`` gives the module y, never a function of x's that
    shares its name (as ``uu.scale`` once did)."""
    clashes = []
    for name, path in sorted(MODULES.items()):
        if path.name != "__init__.py":
            continue
        package = importlib.import_module(f"ipu_unit_scaling.{name}".rstrip("."))
        for sub in MODULES:
            if sub and sub.rpartition(".")[0] == name and sub != name:
                value = getattr(package, sub.rpartition(".")[2], None)
                if value is not None and not isinstance(value, ModuleType):
                    clashes.append(sub)
    new = sorted(set(clashes) - NAME_CLASHES_TODAY)
    assert not new, f"names that are both a submodule and something else: {new}"
    fixed = sorted(NAME_CLASHES_TODAY - set(clashes))
    assert not fixed, f"NAME_CLASHES_TODAY lists what is no longer so (it only shrinks): {fixed}"


# Second names known today: none (the list may only shrink).
SECOND_NAMES_TODAY: set = set()


def test_no_class_or_function_has_a_second_name():
    """A module-level ``Alias = Original`` gives one thing two names; a reader looks for both."""
    aliases = set()
    for name in sorted(MODULES):
        if name.endswith("__main__"):
            continue
        assigned = [target.id for node in _tree(name).body if isinstance(node, ast.Assign)
                    and isinstance(node.value, (ast.Name, ast.Attribute))
                    for target in node.targets
                    if isinstance(target, ast.Name) and not target.id.startswith("_")]
        if not assigned:
            continue
        module = importlib.import_module(f"ipu_unit_scaling.{name}".rstrip("."))
        for alias in assigned:
            value = getattr(module, alias, None)
            if (inspect.isclass(value) or inspect.isfunction(value)) \
                    and getattr(value, "__module__", "").startswith("ipu_unit_scaling") \
                    and value.__name__ != alias:  # type: ignore[union-attr]
                aliases.add(f"{name}.{alias}")
    new = sorted(aliases - SECOND_NAMES_TODAY)
    assert not new, f"classes or functions bound to a second name: {new}"
    fixed = sorted(SECOND_NAMES_TODAY - aliases)
    assert not fixed, f"SECOND_NAMES_TODAY lists what is no longer so (it only shrinks): {fixed}"


# ------------------------------------------------------------ the stand-ins: a leaf of their own

STANDINS = ROOT / "ipu_standins"
STANDIN_MODULES = {".".join(p.relative_to(STANDINS).with_suffix("").parts).replace(
    ".__init__", "").replace("__init__", ""): p for p in STANDINS.rglob("*.py")}
# Stand-in modules with no test module named after them (tests/standins/test_<path>.py, the
# path's dots as underscores, an underscore of a private module dropped) today; the list only
# shrinks.
STANDIN_UNTESTED_TODAY = {
    "", "poptorch._args", "poptorch._compile",
    "poptorch._device_optimizer", "poptorch._lowering",
    "poptorch._graph_ops", "poptorch._impl", "poptorch._lowering_table",
}


def _standin_untested() -> Set[str]:
    stems = {p.stem for p in (ROOT / "tests" / "standins").glob("test_*.py")}
    untested = set()
    for module in STANDIN_MODULES:
        name = "test_" + "_".join(part.lstrip("_") for part in module.split(".")) if module \
            else "test_ipu_standins"
        if not any(s == name or s.startswith(name + "_") for s in stems):
            untested.add(module)
    return untested


def test_the_standins_import_nothing_of_the_package_and_the_package_reaches_them_publicly():
    """The stand-ins depend on torch alone; the package takes no private name of theirs
    (it reaches them as a program reaches PopTorch: the public API, ``poptorch.custom_op``,
    and the stand-ins' own public modules)."""
    into_package, private = [], []
    for module, path in sorted(STANDIN_MODULES.items()):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                else [])
            into_package += [f"{module}: {n}" for n in names
                             if n.split(".")[0] == "ipu_unit_scaling"]
    for name in sorted(MODULES):
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[0] == "ipu_standins":
                parts = node.module.split(".") + [a.name for a in node.names]
                private += [f"{name}: {node.module}" for p in parts if _is_private(p)]
    assert not into_package, f"stand-in modules importing the package: {into_package}"
    assert not private, f"package modules taking a private name of a stand-in: {private}"


def test_the_standins_files_are_short_and_each_module_has_a_test_module():
    lengths = {p: len(p.read_text(encoding="utf-8").splitlines())
               for p in STANDIN_MODULES.values()}
    long = sorted(f"{p.relative_to(ROOT)} ({n})" for p, n in lengths.items()
                  if n > LONG_FILE_LINES)
    assert not long, f"stand-in files over {LONG_FILE_LINES} lines: {long}"
    untested = _standin_untested()
    missing = sorted(untested - STANDIN_UNTESTED_TODAY)
    assert not missing, "stand-in modules with no tests/standins/test_<module>.py: " + str(missing)
    tested = sorted(STANDIN_UNTESTED_TODAY - untested)
    assert not tested, "STANDIN_UNTESTED_TODAY lists modules that now have one: " + str(tested)

"""The code stays Python 3.8 code (the Poplar SDK's Python), checked from any newer Python.

Two checks: every file parses with the 3.8 grammar, and nothing that 3.8 cannot evaluate
(`list[int]`, `int | None`) is evaluated at run time. Annotations are exempt where the module
has `from __future__ import annotations`, except for class-level ones: `typing.get_type_hints`
evaluates those (the config schema reads its dataclasses that way).
"""
from __future__ import annotations

import ast
from typing import List, Set, Tuple

import pytest
from helpers import ROOT

SOURCES = sorted(
    [path for folder in ("ipu_unit_scaling", "benchmarks", "scripts", "tests")
     for path in (ROOT / folder).rglob("*.py")] + [ROOT / "setup.py"]
)
PYTHON_38 = (3, 8)
# Builtins that became subscriptable (PEP 585) or joinable with `|` (PEP 604) after 3.8.
TYPE_BUILTINS = {"list", "dict", "tuple", "set", "frozenset", "type", "int", "float", "str",
                 "bytes", "bool", "complex", "object"}
SUBSCRIPTABLE_AFTER_38 = {"list", "dict", "tuple", "set", "frozenset", "type"}


def annotation_nodes(tree: ast.AST) -> Tuple[Set[int], Set[int]]:
    """ids of the nodes inside annotations: (postponable ones, class-body ones)."""
    in_class: List[ast.AST] = []
    elsewhere: List[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            in_class.extend(s.annotation for s in node.body if isinstance(s, ast.AnnAssign))
        elif isinstance(node, ast.AnnAssign):
            elsewhere.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            every = (arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                     + [a for a in (arguments.vararg, arguments.kwarg) if a is not None])
            elsewhere.extend(a.annotation for a in every if a.annotation is not None)
            if node.returns is not None:
                elsewhere.append(node.returns)
    class_ids = {id(inner) for root in in_class for inner in ast.walk(root)}
    other_ids = {id(inner) for root in elsewhere for inner in ast.walk(root)} - class_ids
    return other_ids, class_ids


def newer_than_38(node: ast.AST) -> bool:
    """`list[...]` and friends, or a `|` with a type or None on one side."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.value, ast.Name) and node.value.id in SUBSCRIPTABLE_AFTER_38
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return any(
            (isinstance(side, ast.Name) and side.id in TYPE_BUILTINS)
            or (isinstance(side, ast.Constant) and side.value is None)
            or (isinstance(side, ast.Subscript) and newer_than_38(side))
            for side in (node.left, node.right)
        )
    return False


def runtime_problems(source: str) -> List[str]:
    """What Python 3.8 would fail to evaluate when running this source."""
    tree = ast.parse(source, feature_version=PYTHON_38)
    postponed = any(
        isinstance(node, ast.ImportFrom) and node.module == "__future__"
        and any(alias.name == "annotations" for alias in node.names)
        for node in tree.body
    )
    function_annotations, class_annotations = annotation_nodes(tree)
    problems = []
    if (function_annotations or class_annotations) and not postponed:
        problems.append("annotations without `from __future__ import annotations`")
    for node in ast.walk(tree):
        if not newer_than_38(node) or (postponed and id(node) in function_annotations):
            continue
        where = "class annotation" if id(node) in class_annotations else "expression"
        text = ast.get_source_segment(source, node)
        problems.append(f"line {node.lineno}: {where} {text!r} needs Python >= 3.9")
    return problems


def test_the_grammar_check_refuses_newer_syntax() -> None:
    """`feature_version` really restricts the grammar on the Python running the suite."""
    newer = [
        "match x:\n    case 1:\n        pass\n",  # 3.10
        "with (open(a) as f, open(b) as g):\n    pass\n",  # 3.9
        "try:\n    pass\nexcept* ValueError:\n    pass\n",  # 3.11
    ]
    for source in newer:
        with pytest.raises(SyntaxError):
            ast.parse(source, feature_version=PYTHON_38)


def test_every_file_parses_with_the_python_3_8_grammar() -> None:
    assert len(SOURCES) > 50
    failures = []
    for path in SOURCES:
        try:
            ast.parse(path.read_text(encoding="utf-8"), str(path), feature_version=PYTHON_38)
        except SyntaxError as error:
            failures.append(f"{path.relative_to(ROOT)}:{error.lineno}: {error.msg}")
    assert not failures, "\n".join(failures)


def test_the_runtime_check_finds_what_3_8_cannot_evaluate() -> None:
    head = "from __future__ import annotations\n"
    assert runtime_problems(head + "def f(x: list[int]) -> int | None:\n    return None\n") == []
    assert runtime_problems(head + "Alias = dict[str, int]\n")
    assert runtime_problems(head + "ok = isinstance(1, int | float)\n")
    assert runtime_problems(head + "x = cast(Optional[int] | None, y)\n")
    assert runtime_problems(head + "class C:\n    field: list[int]\n")
    assert runtime_problems(head + "class C:\n    field: Optional[int] | None\n")
    assert runtime_problems("def f(x: int) -> None:\n    pass\n")  # no postponed annotations
    assert runtime_problems(head + "flags = a | b\nclass C:\n    field: List[int]\n") == []


def test_nothing_newer_than_3_8_is_evaluated_at_run_time() -> None:
    failures = [
        f"{path.relative_to(ROOT)}: {problem}"
        for path in SOURCES
        for problem in runtime_problems(path.read_text(encoding="utf-8"))
    ]
    assert not failures, "\n".join(failures)

"""The documentation site builds in strict mode: a broken link, anchor or API reference fails.

Needs the ``docs`` extra (``pip install -e ".[docs]"``); skipped, saying so, without it.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Dict, List

import pytest
from helpers import ROOT

PLUGINS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
# Modules without a reference page of their own: the modules and scale primitives that
# `import ipu_unit_scaling as uu` re-exports (on its page), and the eager fast paths behind the
# `U` ops, which have no API of their own.
DOCUMENTED_ELSEWHERE = {"modules", "scale"}


def _missing_plugins() -> list:
    return [name for name in PLUGINS if importlib.util.find_spec(name.split(".")[0]) is None
            or importlib.util.find_spec(name) is None]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, env=environment, timeout=600)


@pytest.fixture(scope="module")
def needs_mkdocs() -> None:
    missing = _missing_plugins()
    if missing:
        pytest.skip(f"the docs extra is not installed (missing {', '.join(missing)}); "
                    "pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(needs_mkdocs, tmp_path_factory) -> Path:
    """The site, built once for the tests that read it."""
    directory = tmp_path_factory.mktemp("docs") / "site"
    result = _build(ROOT / "mkdocs.yml", directory)
    assert result.returncode == 0, result.stdout + result.stderr
    return directory


def test_site_builds_strictly(site):
    assert (site / "index.html").is_file()
    reference = (site / "api" / "functional" / "index.html").read_text("utf-8")
    assert 'id="ipu_unit_scaling.functional.linear"' in reference, "no API reference rendered"


# Objects the API reference documents twice today: none (the list may only shrink).
DOCUMENTED_TWICE_TODAY: set = set()
_HEADING = re.compile(r'<h\d id="(ipu_unit_scaling[\w.]*)" class="doc doc-heading"')
_MISSING = object()


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part, _MISSING)
            if value is _MISSING:
                break
        return value
    return _MISSING


def test_each_function_and_class_is_documented_once(site):
    """The API reference documents each function and class of the package on one page, under
    one name: a module that serves another's names links to them."""
    where: Dict[str, List[str]] = {}
    for page in sorted((site / "api").rglob("index.html")):
        for identifier in _HEADING.findall(page.read_text("utf-8")):
            if not isinstance(_resolve(identifier.rsplit(".", 1)[0]), types.ModuleType):
                continue  # a member of a class, documented with it
            value = _resolve(identifier)
            module = getattr(value, "__module__", None) or ""
            if not (inspect.isclass(value) or inspect.isfunction(value)) \
                    or not module.startswith("ipu_unit_scaling"):
                continue
            written = f"{module}.{value.__qualname__}"  # type: ignore[union-attr]
            where.setdefault(written, []).append(f"{page.parent.name}: {identifier}")
    assert len(where) > 100, f"only {len(where)} objects found in the API reference"
    twice = {name: pages for name, pages in where.items()
             if len(pages) > 1 and name not in DOCUMENTED_TWICE_TODAY}
    assert not twice, f"documented more than once: {twice}"
    once = sorted(name for name in DOCUMENTED_TWICE_TODAY if len(where.get(name, [])) < 2)
    assert not once, f"DOCUMENTED_TWICE_TODAY lists what is no longer so (it only shrinks): {once}"


def test_the_uu_page_names_every_name_of_uu():
    import ipu_unit_scaling

    page = (ROOT / "docs" / "api" / "uu.md").read_text("utf-8")
    missing = [name for name in ipu_unit_scaling.__all__ if f"`uu.{name}`" not in page]
    assert not missing, f"names of uu missing from docs/api/uu.md: {missing}"


def test_a_broken_link_fails_the_build(needs_mkdocs, tmp_path):
    """The check above can fail: the same site with one dangling link does not build."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the guide](guide/missing.md).\n")
    config = tmp_path / "mkdocs.yml"
    text = (ROOT / "mkdocs.yml").read_text("utf-8")
    config.write_text(text.split("\nnav:")[0].replace("docs_dir: docs", f"docs_dir: {docs}")
                      + "\nnav:\n  - index.md\n")
    result = _build(config, tmp_path / "site")
    assert result.returncode != 0
    assert "guide/missing.md" in result.stdout + result.stderr


def test_every_public_module_has_a_reference_page():
    """No module is left out of the API reference (this needs no mkdocs)."""
    package = ROOT / "ipu_unit_scaling"
    modules = {path.stem for path in package.glob("*.py")} | {
        path.parent.name for path in package.glob("*/__init__.py")}
    public = {name for name in modules if not name.startswith("_")}
    documented = {line.split()[1] for page in (ROOT / "docs" / "api").glob("*.md")
                  for line in page.read_text("utf-8").splitlines() if line.startswith("::: ")}
    missing = sorted(name for name in public - DOCUMENTED_ELSEWHERE
                     if f"ipu_unit_scaling.{name}" not in documented)
    assert not missing, f"modules of ipu_unit_scaling without a docs/api page: {missing}"
    pages = (ROOT / "mkdocs.yml").read_text("utf-8")
    unlisted = [page.name for page in (ROOT / "docs" / "api").glob("*.md")
                if f"api/{page.name}" not in pages]
    assert not unlisted, f"docs/api pages missing from mkdocs.yml's nav: {unlisted}"

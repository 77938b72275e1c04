"""The documentation site builds in strict mode: a broken link, anchor or API reference fails.

Needs the ``docs`` extra (``pip install -e ".[docs]"``); skipped, saying so, without it.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


def test_site_builds_strictly(needs_mkdocs, tmp_path):
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    reference = (tmp_path / "site" / "api" / "functional" / "index.html").read_text("utf-8")
    assert 'id="ipu_unit_scaling.functional.linear"' in reference, "no API reference rendered"


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

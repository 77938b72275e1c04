"""The site's navigation names every page, and its API pages show members."""
from __future__ import annotations

import importlib
import re
from typing import Iterator, Optional, Tuple

import yaml
from helpers import ROOT


def _pages(nav) -> Iterator[Tuple[Optional[str], str]]:
    """(the title mkdocs.yml gives, or None; the page) of every page in ``nav``."""
    for item in nav:
        if isinstance(item, str):
            yield None, item
            continue
        for name, value in item.items():
            if isinstance(value, str):
                yield name, value
            else:
                yield from _pages(value)


def _nav() -> list:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    return yaml.safe_load("nav:" + text.split("\nnav:", 1)[1])["nav"]


def test_every_page_in_the_navigation_has_a_title():
    # A page listed without a title is named by its first heading; a page without one is named
    # after its file ("Gelu", "Report").
    pages = list(_pages(_nav()))
    assert len(pages) > 20
    for title, page in pages:
        if title is None:
            text = (ROOT / "docs" / page).read_text(encoding="utf-8").lstrip()
            assert text.startswith("# "), f"{page}: no title in mkdocs.yml and no heading"


def test_api_pages_render_modules_that_have_members():
    # A module whose public names are all submodules shows nothing unless its page asks for
    # its submodules (the `ipu_unit_scaling.core` page was one line).
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"^::: (\S+)", text, re.M):
            try:
                imported = importlib.import_module(target)
            except ImportError:
                continue  # an object in a module, not a module
            members = [name for name in getattr(imported, "__all__", ["?"])
                       if not isinstance(getattr(imported, name, None), type(re))]
            assert members or "show_submodules: true" in text, \
                f"{page.name}: {target} has only submodules, which it does not show"

"""The documentation stays true (issue 40): the pages made from the code are what the code makes
now (``make docs``), and every relative link in README.md, BENCHMARKS.md and docs/ reaches a file
and, with an anchor, a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.docs import pages

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as the forge makes it: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [m.group(1) for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", sorted(pages()), ids=lambda p: p.name)
def test_generated_pages_match_the_code(page: Path) -> None:
    assert page.read_text() == pages()[page], f"{page.name} is stale: run `make docs`"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_their_file_and_heading(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor}")
    assert broken == []


def test_the_readme_is_short_and_every_page_is_linked() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    linked = {Path(t.partition("#")[0]).name for t in links(ROOT / "README.md")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked

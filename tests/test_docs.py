"""The README's and docs' relative links lead somewhere: every linked file exists, and every ``#anchor`` names a heading
of the page it points into (GitHub's rule: lower case, punctuation dropped, spaces as hyphens)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (a ``#`` comment in one is not a heading, a ``](x)`` not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``."""
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def relative_links(page: Path) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text()))
    return [link for link in links if not link.startswith(("http://", "https://", "mailto:"))]


def test_the_pages_have_links_to_check():
    assert sum(len(relative_links(page)) for page in PAGES) >= 40
    assert "model-size-validation" in anchors(ROOT / "docs" / "results.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for link in relative_links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading of {target.name} has the anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)

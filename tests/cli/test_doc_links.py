"""Every link between the docs lands: a linked page exists, and a linked ``#anchor`` is one
of that page's headings (GitHub's slugs: lower case, punctuation dropped, spaces to
hyphens; a repeated heading gets ``-1``, ``-2``...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_LINK = re.compile(r"\]\(([^)\s]*)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_between_the_docs_lands(page: Path) -> None:
    broken = []
    for link in links(page):
        if "://" in link or link.startswith("mailto:"):
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no file {path.relative_to(ROOT)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)}: broken links"


def test_every_module_the_architecture_page_names_exists() -> None:
    """docs/architecture.md walks a hand-over naming modules (``group/driver.py``,
    ``client/_session.py``, ...): each must be a module of the package, found under the
    package the page's section is about or from ``src/tslice`` itself."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    src = ROOT / "src" / "tslice"
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", page))
    assert len(named) >= 25, named  # (the walk names about thirty)
    roots = [ROOT, src, src / "orchestrator", src / "agent", src / "client"]
    missing = sorted(n for n in named if not any((r / n).is_file() for r in roots))
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"

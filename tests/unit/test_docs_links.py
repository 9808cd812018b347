"""The documentation's map holds: every relative link in the project's Markdown pages
names a file that exists and, with an anchor into a page, a heading that page has (as
GitHub makes anchors of headings). Pages are reorganised by reader task; a moved
section must take its links with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md"),
                *ROOT.glob("tests/*/README.md")})
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped,
    spaces made hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def links(page: Path) -> list[str]:
    return [link for link in LINK.findall(FENCE.sub("", page.read_text()))
            if not re.match(r"[a-z]+:", link)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for link in links(page):
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{link}: {path.name} has no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_anchor_rule_matches_githubs() -> None:
    assert anchor("The DRA driver's guard: a node writes only its own slices") == \
        "the-dra-drivers-guard-a-node-writes-only-its-own-slices"
    assert anchor("`dra` flags") == "dra-flags"
    assert anchor("Nodes without AppArmor (SELinux distributions)") == \
        "nodes-without-apparmor-selinux-distributions"

"""Every relative link of the documentation leads somewhere: README.md, CONTRIBUTING.md and docs/*.md link to
each other by path (and to headings by anchor), and a page moved or a heading renamed must not leave a link
pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and [text](target "title"); text may run over a line break.
INLINE = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """The text without code blocks and code spans: a link written inside code is an example, not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces made hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    return [m.group(1) for pattern in (INLINE, IMAGE, REFERENCE) for m in pattern.finditer(text)]


def broken(page: Path) -> list[str]:
    out = []
    for link in links(page):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", link):  # http:, https:, mailto:: not ours to check
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            out.append(f"{link}: no such file")
        elif REPO not in target.parents and target != REPO:
            out.append(f"{link}: outside the repository")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            out.append(f"{link}: {target.relative_to(REPO)} has no heading #{fragment}")
    return out


def test_the_pages_are_there():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_every_docs_page_is_listed_in_the_index():
    index = {link.partition("#")[0] for link in links(REPO / "docs" / "README.md")}
    pages = {p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md"}
    assert pages <= index, sorted(pages - index)


def test_the_checker_sees_what_it_should(tmp_path):
    """The checker itself: links in code are skipped, anchors follow GitHub's rule, a missing file is found."""
    assert slug("Training data: Dataset, exports, verify") == "training-data-dataset-exports-verify"
    assert slug("Several model servers, one queue") == "several-model-servers-one-queue"
    assert slug("`hsx serve` flags") == "hsx-serve-flags"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Title\n\nSee [a](#title-1), [b](missing.md),\n[c\nd](page.md#title) and `[e](nowhere.md)`.\n\n"
        "```\n[f](nowhere.md)\n```\n\n[g]: other.md\n",
        encoding="utf-8",
    )
    assert links(page) == ["#title-1", "missing.md", "page.md#title", "other.md"]

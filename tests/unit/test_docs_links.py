"""Every relative link of README.md, CHANGELOG.md and docs/**/*.md leads to a file that
exists, and a ``#fragment`` into a Markdown file to one of its headings (GitHub's ids)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6} +(?P<title>.+?) *#*$", re.MULTILINE)


def documents() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    changelog = ROOT / "CHANGELOG.md"
    return [*found, changelog] if changelog.exists() else found


def heading_ids(markdown: str) -> set[str]:
    """GitHub's anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = FENCE.sub("", markdown)
    return {
        re.sub(r"[^\w\- ]", "", match["title"].lower()).replace(" ", "-")
        for match in HEADING.finditer(text)
    }


def broken_links(document: Path) -> list[str]:
    """The relative links of ``document`` that lead nowhere, each with why."""
    text = CODE_SPAN.sub("", FENCE.sub("", document.read_text()))
    broken: list[str] = []
    for match in LINK.finditer(text):
        target = match["target"]
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            broken.append(f"{document.name}: {target} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in heading_ids(path.read_text()):
            broken.append(f"{document.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    docs = documents()
    assert ROOT / "README.md" in docs and len(docs) > 3
    broken = [problem for document in docs for problem in broken_links(document)]
    assert not broken, "\n".join(broken)


def test_a_broken_link_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A title: with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-title-with-code) [in code](`x.md`) `[span](gone.md)`\n"
        "[gone](gone.md) [bad](there.md#nope) ![img](img.png) [web](https://example.com)\n"
    )
    assert broken_links(page) == [
        "page.md: gone.md (no such file)",
        "page.md: there.md#nope (no such heading)",
        "page.md: img.png (no such file)",
    ]

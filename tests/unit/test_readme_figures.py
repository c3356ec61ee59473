"""Every figure the README's headline table states is in the JSON its results page keeps.

Each row of the table between ``<!-- headline:begin -->`` and ``<!-- headline:end -->`` links
to a page under ``docs/results/`` and carries a mark ``<!-- figures: FILE.json PATH ... -->``:
the JSON file beside that page and one key path (dotted; list items by index) per number of
the row's "measured" cell, in order. A number matches when the JSON value rounds to it at
the precision written.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"<!-- headline:begin -->\n(.*?)\n<!-- headline:end -->", re.DOTALL)
MARK = re.compile(r"<!-- figures: (?P<file>[\w.-]+\.json)(?P<paths>(?: [\w.]+)+) -->")
PAGE_LINK = re.compile(r"\]\(docs/results/(?P<page>[\w.-]+\.md)\)")
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.])")


@attrs.frozen
class Row:
    """One headline row: its measured cell, the page it links to, the JSON and key paths."""

    text: str
    measured: str
    page: str | None
    json_file: str | None
    paths: tuple[str, ...]

    @classmethod
    def parse(cls, line: str) -> Row:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3:
            raise ValueError(f"expected 3 cells (what, measured, where), found {len(cells)}")
        page = PAGE_LINK.search(cells[2])
        mark = MARK.search(cells[2])
        return cls(
            text=line,
            measured=cells[1],
            page=page["page"] if page else None,
            json_file=mark["file"] if mark else None,
            paths=tuple(mark["paths"].split()) if mark else (),
        )


def value_at(data: object, path: str) -> object:
    """``data`` walked along the dotted ``path`` (an integer part indexes a list)."""
    for part in path.split("."):
        if isinstance(data, dict):
            data = data[part]
        elif isinstance(data, list):
            data = data[int(part)]
        else:
            raise KeyError(f"{path}: {part!r} reached a {type(data).__name__}")
    return data


def rounds_to(value: object, written: str) -> bool:
    """Whether the JSON ``value`` rounds to ``written`` at the precision it is written with."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    decimals = len(written.partition(".")[2])
    return bool(abs(value - float(written)) <= 0.5 * 10.0**-decimals + 1e-12)


def problems(row: Row, results: Path) -> list[str]:
    """What is wrong with ``row``: no page or mark, a JSON its page does not give, a number
    with no key path or a key path with no number, a number the JSON does not hold."""
    if row.page is None or row.json_file is None:
        return [f"needs a link to docs/results/*.md and a figures mark: {row.text}"]
    page = results / row.page
    json_path = results / row.json_file
    if not page.is_file() or not json_path.is_file():
        return [f"missing {page.name} or {json_path.name}: {row.text}"]
    found: list[str] = []
    if f"]({row.json_file})" not in page.read_text():
        found.append(f"{row.page} does not link {row.json_file}")
    numbers = NUMBER.findall(row.measured)
    if len(numbers) != len(row.paths):
        found.append(f"{len(numbers)} numbers {numbers} for {len(row.paths)} key paths: {row.text}")
        return found
    data = json.loads(json_path.read_text())
    for written, path in zip(numbers, row.paths, strict=True):
        value = value_at(data, path)
        if not rounds_to(value, written):
            found.append(f"{row.json_file} {path} is {value!r}, the README says {written}")
    return found


def headline_rows() -> list[Row]:
    block = BLOCK.search((ROOT / "README.md").read_text())
    assert block, "README.md needs its headline table between the headline marks"
    lines = [line for line in block.group(1).splitlines() if line.startswith("|")]
    return [Row.parse(line) for line in lines[2:]]  # past the header and the separator


def test_every_headline_figure_is_in_the_json_its_page_keeps() -> None:
    rows = headline_rows()
    assert rows, "the headline table has no rows"
    found = [problem for row in rows for problem in problems(row, RESULTS)]
    assert not found, "\n".join(found)


def test_a_figure_the_json_does_not_hold_is_reported(tmp_path: Path) -> None:
    (tmp_path / "page.md").write_text("[raw](2000-01-01-x.json)\n")
    (tmp_path / "2000-01-01-x.json").write_text(json.dumps({"a": {"b": [0.1234]}, "n": 7}))
    mark = "<!-- figures: 2000-01-01-x.json a.b.0 n -->"
    good = f"| x | 0.123; 7 | [p](docs/results/page.md) {mark} |"
    assert problems(Row.parse(good), tmp_path) == []
    wrong = good.replace("0.123; 7", "0.125; 7")
    said = "2000-01-01-x.json a.b.0 is 0.1234, the README says 0.125"
    assert problems(Row.parse(wrong), tmp_path) == [said]
    unmarked = good.replace("; 7", "; 7; 9")
    assert "3 numbers" in problems(Row.parse(unmarked), tmp_path)[0]
    assert problems(Row.parse("| x | 1 s | nowhere |"), tmp_path)[0].startswith("needs a link")

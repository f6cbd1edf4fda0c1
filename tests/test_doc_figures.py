"""Every figure the README and the manual quote in a figures table comes from
the result file named beside it: each number of its "figure" cell is one
the file records (to the precision shown), and its machine and date are the
file's own. A figure that no current result file holds fails here, so a
table cannot go stale silently (issue 43, part 3).

A figures table is a Markdown table whose header has a "figure" column and
a "source" column linking into ``bench/results/``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(\s*M\b)?")
_LINK = re.compile(r"\]\(([^)]*bench/results/[^)]+)\)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def figure_rows(path: Path) -> list[tuple[int, dict[str, str]]]:
    """(line number, {column: cell}) of every row of every figures table in ``path``."""
    rows, header = [], None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [c.lower() for c in cells]
            if not ("figure" in header and "source" in header):
                header = []
            continue
        if not header or set("".join(cells)) <= set("-: "):
            continue
        rows.append((n, dict(zip(header, cells))))
    return rows


def _numbers(value) -> list[float]:
    """Every number a result file records, however deep."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return []


def _shown(text: str) -> list[tuple[float, float]]:
    """(value, half a unit of its last digit) of each number in ``text``; "2.07 M" is 2.07e6."""
    out = []
    for digits, mega in _NUMBER.findall(text):
        plain = digits.replace(",", "")
        decimals = len(plain.partition(".")[2])
        scale = 1e6 if mega else 1.0
        out.append((float(plain) * scale, 0.5 * 10.0 ** -decimals * scale))
    return out


CASES = [(path, n, row) for path in DOCS for n, row in figure_rows(path)]


def test_the_readme_has_a_figures_table():
    assert any(path.name == "README.md" for path, _, _ in CASES)


@pytest.mark.parametrize("path, line, row", CASES, ids=[f"{p.name}:{n}" for p, n, _ in CASES])
def test_each_figure_is_in_its_result_file(path, line, row):
    links = _LINK.findall(row["source"])
    assert links, f"{path.name}:{line}: no link into bench/results/ in {row['source']!r}"
    files = [(path.parent / link).resolve() for link in links]
    for f in files:
        assert f.is_file(), f"{path.name}:{line}: {f} does not exist"
    records = [json.loads(f.read_text()) for f in files]
    recorded = [x for r in records for x in _numbers(r)]
    for value, half in _shown(row["figure"]):
        assert any(math.isclose(value, x, abs_tol=half + 1e-9) for x in recorded), (
            f"{path.name}:{line}: {value:g} is in no number of {[f.name for f in files]}")
    when = next((v for k, v in row.items() if "date" in k), "")
    for date in re.findall(r"\d{4}-\d{2}-\d{2}", when):
        assert any(str(r.get("date", "")).startswith(date) for r in records), (
            f"{path.name}:{line}: no source file is dated {date}")
    if "H200" in when:  # the file's gpu field; a tandem play report before it had one: its name says _h200
        assert any("H200" in str(r.get("gpu", "")) or f.name.endswith("_h200.json") for r, f in zip(records, files)), (
            f"{path.name}:{line}: no source ran on an H200")

"""The results shelf and the manual's citations (issue 43, part 3).

``bench/results/`` holds one current file per figure the documents quote,
named by benchmark and machine, never by commit: every file there is named
by the README, a page of ``docs/`` or ``bench/README.md``. Those documents,
the model cards and the client's and deployment's READMEs cite no commit
(the history lives in git) and no path outside the repository (nor one of
the machine a benchmark ran on). Upstream provenance is not history: a
40-digit commit of a named upstream repository and a file's sha256 may stand
in them, and ``data/README.md``, which records where the bundled data came
from (upstream commits, the team's source folder), is not checked.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CHECKED = [*DOCS, *sorted((ROOT / "reward_service" / "models").glob("*.md")),
           ROOT / "clients" / "python" / "README.md", ROOT / "deploy" / "README.md"]
_HEX = re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w-])")
_LINK = re.compile(r"\]\(([^)#\s]+)")
_OUTSIDE = ("/work/", "/work`", "/work)", "/root/")  # this host's and the GPU machine's folders
# A relative path up and out of the document's folder ("../data/x.csv"), in a link or in the text.
_UP = re.compile(r"(?<![\w./-])((?:\.\./)+[\w./-]*[\w/])")
# Provenance, not history: `owner/repo` commit <40 hex digits>, and a file's sha256.
_PROVENANCE = re.compile(r"`[\w.-]+/[\w.-]+` commit ([0-9a-f]{40})\b|sha256 ([0-9a-f]{7,64})")


def _shelf() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*") if p.is_file())


def _is_commit(token: str) -> bool:
    """A hex token with a digit and a letter: what a commit hash looks like (a year or a word is not)."""
    return bool(re.search(r"\d", token)) and bool(re.search(r"[a-f]", token))


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_the_shelf_is_small():
    assert 0 < len(_shelf()) <= 40, [p.name for p in _shelf()]


@pytest.mark.parametrize("path", _shelf(), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_each_result_file_is_quoted_by_a_document(path):
    rel = path.relative_to(RESULTS).as_posix()
    quoted = [d for d in DOCS if re.search(r"(?<![\w.-])" + re.escape(rel) + r"(?![\w-])", _text(d))]
    assert quoted, f"bench/results/{rel} is named by no document (README.md, docs/, bench/README.md): quote it or remove it"


@pytest.mark.parametrize("path", _shelf(), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_no_result_file_is_named_by_a_commit(path):
    tokens = [t for t in re.split(r"[_.\-/]", path.relative_to(RESULTS).as_posix()) if _HEX.fullmatch(t)]
    assert not tokens, f"{path.name}: name it by benchmark and machine, not by commit ({tokens})"


def _provenance(line: str) -> set[str]:
    return {h for m in _PROVENANCE.finditer(line) for h in m.groups() if h}


@pytest.mark.parametrize("doc", CHECKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_document_cites_a_commit(doc):
    hits = [(n, m.group()) for n, line in enumerate(_text(doc).splitlines(), 1)
            for m in _HEX.finditer(line) if _is_commit(m.group()) and m.group() not in _provenance(line)]
    assert not hits, f"{doc.relative_to(ROOT)}: commit-like tokens {hits}: give the date and machine instead"


def test_provenance_is_told_from_a_commit_of_tandem():
    upstream = "via GitHub `mbarbin/c4solver` commit 39cd6353a09418b36f864b9e3763b7aaa7df7c69."
    assert _provenance(upstream) == {"39cd6353a09418b36f864b9e3763b7aaa7df7c69"}
    assert _provenance("The previous file (sha256 61a9a537d24304ea…)") == {"61a9a537d24304ea"}
    assert not _provenance("git show 1a35c2b:reward_service/models/connect4_value.onnx")


@pytest.mark.parametrize("doc", CHECKED, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_document_cites_a_path_outside_the_repository(doc):
    text = _text(doc)
    bad = [s for s in _OUTSIDE if s in text]
    for target in _UP.findall(text):  # must name a file or folder of the repository
        resolved = (doc.parent / target).resolve()
        if (ROOT not in resolved.parents and resolved != ROOT) or not resolved.exists():
            bad.append(target)
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        resolved = (doc.parent / target).resolve()
        if ROOT not in resolved.parents and resolved != ROOT:
            bad.append(target)
    assert not bad, f"{doc.relative_to(ROOT)} cites paths outside the repository: {bad}"

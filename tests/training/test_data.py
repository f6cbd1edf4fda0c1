"""The shipped Connect Four position files: they parse, match data/README.md,
are self-consistent, and agree with the bitbully solver on a sample.

Reads only files inside the repository (data/connect4/). Conventions: 1-indexed
columns, Pons' score convention (see data/README.md).
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import json
import random
import re
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "data"
C4 = DATA / "connect4"
PONS = ("Test_L3_R1", "Test_L2_R1", "Test_L1_R1", "Test_L1_R2")
SOLVER_FILE = C4 / "solver" / "uci_random_walks.jsonl.gz"
# Random walks from the empty board: file -> inclusive stone-count range.
WALKS = {"walks/walks_05-11.jsonl.gz": (5, 11), "walks/walks_12-17.jsonl.gz": (12, 17),
         "walks/walks_18-41.jsonl.gz": (18, 41), "walks/walks_more_12-14.jsonl.gz": (12, 14),
         "walks/walks_next_08-11.jsonl.gz": (8, 11), "walks/walks_next_12-14.jsonl.gz": (12, 14)}
ROWS, COLS = 6, 7


# ---------------------------------------------------------------- helpers

def replay(moves: str) -> list:
    """1-indexed move string -> grid[col][row] of 0 (empty), 1 (first), 2 (second)."""
    grid = [[0] * ROWS for _ in range(COLS)]
    heights = [0] * COLS
    for i, ch in enumerate(moves):
        c = int(ch) - 1
        assert 0 <= c < COLS and heights[c] < ROWS, f"illegal move in {moves}"
        grid[c][heights[c]] = 1 + i % 2
        heights[c] += 1
    return grid


def has_four(grid) -> bool:
    """True when either player has four in a row."""
    for c in range(COLS):
        for r in range(ROWS):
            p = grid[c][r]
            if not p:
                continue
            for dc, dr in ((1, 0), (0, 1), (1, 1), (1, -1)):
                if all(0 <= c + k * dc < COLS and 0 <= r + k * dr < ROWS
                       and grid[c + k * dc][r + k * dr] == p for k in range(4)):
                    return True
    return False


def key(moves: str) -> tuple:
    """Position key, equal for mirror images."""
    g = tuple(tuple(col) for col in replay(moves))
    return min(g, g[::-1])


def read_jsonl(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def read_uci() -> list:
    with gzip.open(C4 / "uci" / "connect-4.shared90.csv.gz", "rt", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def uci_as_record(r: dict) -> dict:
    ms = {str(c): (int(r[f"s{c}"]) if r[f"s{c}"] else None) for c in range(1, 8)}
    best = max(v for v in ms.values() if v is not None)
    return {"moves": r["moves"], "score": int(r["score"]), "move_scores": ms,
            "best_moves": [int(c) for c, v in ms.items() if v == best]}


def wdl(records) -> tuple:
    s = [r["score"] for r in records]
    return (sum(x > 0 for x in s), sum(x == 0 for x in s), sum(x < 0 for x in s))


def readme_counts() -> dict:
    """{file path: (positions, win, draw, loss)} from the counts table in data/README.md."""
    out = {}
    for line in (DATA / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(\d+)\s*\|[^|]*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|", line)
        if m:
            out[m.group(1)] = tuple(int(m.group(i)) for i in range(2, 6))
    return out


@pytest.fixture(scope="module")
def sets() -> dict:
    """{README path: list of records} for every shipped labelled file."""
    out = {f"pons/{n}.jsonl": read_jsonl(C4 / "pons" / f"{n}.jsonl") for n in PONS}
    out["uci/connect-4.shared90.csv.gz"] = [uci_as_record(r) for r in read_uci()]
    out["solver/uci_random_walks.jsonl.gz"] = read_jsonl(SOLVER_FILE)
    for path in WALKS:
        out[path] = read_jsonl(C4 / path)
    return out


# ---------------------------------------------------------------- tests

def test_counts_match_readme(sets):
    table = readme_counts()
    assert set(table) == set(sets), "README counts table must list exactly the shipped files"
    for path, records in sets.items():
        assert (len(records), *wdl(records)) == table[path], path


def test_pons_jsonl_matches_raw_files(sets):
    for name in PONS:
        raw = (C4 / "pons" / name).read_text().split("\n")
        raw = [line.split() for line in raw if line]
        recs = sets[f"pons/{name}.jsonl"]
        assert [(r["moves"], r["score"]) for r in recs] == [(m, int(s)) for m, s in raw]


def test_uci_rows_replay_and_match_label():
    rows = read_uci()
    assert list(rows[0]) == ["line", "moves", "board", "label", "score"] + [f"s{c}" for c in range(1, 8)]
    sign = {"win": 1, "draw": 0, "loss": -1}
    for r in rows:
        grid = replay(r["moves"])
        cells = "".join("bxo"[grid[c][row]] for c in range(COLS) for row in range(ROWS))
        assert cells == r["board"], r["line"]
        s = int(r["score"])
        assert (s > 0) - (s < 0) == sign[r["label"]], r["line"]
    lines = [int(r["line"]) for r in rows]
    assert lines == sorted(lines) and len(set(lines)) == len(lines)


def test_uci_names_unchanged():
    digest = hashlib.sha256((C4 / "uci" / "connect-4.names").read_bytes()).hexdigest()
    assert digest == "fd1c60618855cf6c5f4c2c05983707566ab414353d4ccc237b8fa372022ba009"


@pytest.mark.slow
def test_labels_self_consistent(sets):
    for path, records in sets.items():
        if path in WALKS:  # 364,000 records: a seeded sample keeps the test to seconds
            records = random.Random(path).sample(records, min(len(records), 4000))
        for r in records:
            grid = replay(r["moves"])
            assert not has_four(grid), (path, r["moves"])
            ms = r["move_scores"]
            assert set(ms) == {str(c) for c in range(1, 8)}
            for c in range(1, 8):
                assert (ms[str(c)] is None) == (grid[c - 1][ROWS - 1] != 0), (path, r["moves"], c)
            legal = {int(c): v for c, v in ms.items() if v is not None}
            assert r["score"] == max(legal.values()), (path, r["moves"])
            assert r["best_moves"] == sorted(c for c, v in legal.items() if v == r["score"])
            # the mover wins at best with its next stone, loses at worst to the opponent's next
            mine = len(r["moves"]) // 2
            theirs = len(r["moves"]) - mine
            assert all(theirs + 1 - 22 <= v <= 22 - (mine + 1) for v in legal.values()), (path, r["moves"])


def test_immediate_wins_scored_by_convention(sets):
    """A move that wins at once scores 22 - (the mover's stone count after it)."""
    for r in sets["solver/uci_random_walks.jsonl.gz"][:3000]:
        for c, v in r["move_scores"].items():
            if v is not None and has_four(replay(r["moves"] + c)):
                assert v == 22 - (len(r["moves"]) // 2 + 1), (r["moves"], c)


def test_solver_positions_are_new_and_in_range(sets):
    recs = sets["solver/uci_random_walks.jsonl.gz"]
    uci_openings = {r["moves"] for r in sets["uci/connect-4.shared90.csv.gz"]}
    keys = [key(r["moves"]) for r in recs]
    assert len(set(keys)) == len(keys), "duplicate positions (up to mirroring)"
    pons = {key(r["moves"]) for n in PONS for r in sets[f"pons/{n}.jsonl"]}
    assert not pons.intersection(keys), "a Pons position (or its mirror) is in the solver set"
    for r in recs:
        assert 10 <= len(r["moves"]) <= 38
        assert r["moves"][:8] in uci_openings


@pytest.mark.slow
def test_walks_are_new_and_in_range(sets):
    """Each walks file: stone counts in its range, no position twice (up to
    mirroring), and none that is a Pons test position, a UCI opening, a
    solver/ position or in another walks file."""
    pons = {key(r["moves"]) for n in PONS for r in sets[f"pons/{n}.jsonl"]}
    others = {key(r["moves"]) for name in ("uci/connect-4.shared90.csv.gz", "solver/uci_random_walks.jsonl.gz")
              for r in sets[name]}
    seen = set()
    for path, (lo, hi) in WALKS.items():
        keys = [key(r["moves"]) for r in sets[path]]
        assert len(set(keys)) == len(keys), f"{path}: duplicate positions (up to mirroring)"
        assert not pons.intersection(keys), f"{path}: a Pons test position (or its mirror)"
        assert not others.intersection(keys), f"{path}: a UCI or solver/ position"
        assert not seen.intersection(keys), f"{path}: a position of another walks file"
        seen.update(keys)
        assert all(lo <= len(r["moves"]) <= hi for r in sets[path]), path


def test_sample_matches_bitbully(sets):
    """Re-solve a seeded sample of positions with >= 20 stones (fast to solve)."""
    bitbully = pytest.importorskip("bitbully")
    agent = bitbully.BitBully()
    pool = [r for name in ("solver/uci_random_walks.jsonl.gz", "walks/walks_18-41.jsonl.gz",
                           "pons/Test_L2_R1.jsonl", "pons/Test_L3_R1.jsonl")
            for r in sets[name] if len(r["moves"]) >= 20]
    for r in random.Random(7).sample(pool, 40):
        scores = agent.score_all_moves(bitbully.Board([int(ch) - 1 for ch in r["moves"]]))
        assert {str(c + 1): scores.get(c) for c in range(COLS)} == r["move_scores"], r["moves"]

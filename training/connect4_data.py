"""Solver-labelled Connect Four positions shipped in ``data/connect4/`` as arrays.

Sources (formats in ``data/README.md``): the UCI compact CSV
(``uci/connect-4.shared90.csv.gz``, 8-stone openings), Pascal Pons' test sets
(``pons/Test_*.jsonl``), the bitbully-labelled random-walk positions from UCI
openings (``solver/*.jsonl.gz``) and from the empty board
(``walks/*.jsonl.gz``, loaded only on request). Every record carries a Pons-convention score for the
side to move and per-column move scores (1-indexed columns in the files,
0-indexed here).

Targets built from the labels:

* value: sign of the score (+1 win, 0 draw, -1 loss for the side to move);
* "good" moves: the legal columns whose move score has the score's sign (they
  keep the theoretical result); in a lost position every move loses, so the
  good moves are the slowest losses (``best_moves``);
* policy: uniform over the good moves.

A move's score is also the exact value of the position it leads to, from the
other side (``child_values``): the training split keeps those positions of a
held-out position out of training, since a search of it is judged by them.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from search_service.games import connect4
from tandem.paths import DATA_DIR as _DATA

from .connect4_encoding import COLS, encode_batch, mirror

DATA_DIR = _DATA / "connect4"
UCI_CSV_GZ = DATA_DIR / "uci" / "connect-4.shared90.csv.gz"
PONS_DIR = DATA_DIR / "pons"
SOLVER_DIR = DATA_DIR / "solver"
WALKS_DIR = DATA_DIR / "walks"

# Training sources and the benchmark sets that must stay out of training.
TRAIN_PONS = ("Test_L1_R1", "Test_L1_R2")
BENCHMARK_PONS = ("Test_L2_R1", "Test_L3_R1")


@dataclass
class PositionSet:
    """A batch of labelled positions; every array has N rows.

    moves        list[str]  1-indexed move strings
    boards       uint8 [N, 2, 6, 7]  model input (see connect4_encoding)
    score        int16 [N]  Pons score for the side to move
    move_scores  int16 [N, 7]  score of each column (0-indexed); 0 where illegal
    legal        bool  [N, 7]  column not full
    good         bool  [N, 7]  moves that keep the result (slowest losses if lost)
    best         bool  [N, 7]  moves whose score equals the position's score
    """

    moves: list
    boards: np.ndarray
    score: np.ndarray
    move_scores: np.ndarray
    legal: np.ndarray
    good: np.ndarray
    best: np.ndarray

    def __len__(self) -> int:
        return len(self.moves)

    @property
    def value_target(self) -> np.ndarray:
        """float32 [N]: sign of the score, +1 win / 0 draw / -1 loss."""
        return np.sign(self.score).astype(np.float32)

    @property
    def policy_target(self) -> np.ndarray:
        """float32 [N, 7]: uniform over the good moves."""
        g = self.good.astype(np.float32)
        return g / g.sum(axis=1, keepdims=True)

    def subset(self, index) -> "PositionSet":
        """Rows selected by a bool mask or an integer index array."""
        idx = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index)
        return PositionSet([self.moves[i] for i in idx], self.boards[idx], self.score[idx],
                           self.move_scores[idx], self.legal[idx], self.good[idx], self.best[idx])

    @staticmethod
    def concat(parts: list) -> "PositionSet":
        """One set holding the rows of ``parts`` in order."""
        return PositionSet(
            [m for p in parts for m in p.moves],
            *(np.concatenate([getattr(p, f) for p in parts])
              for f in ("boards", "score", "move_scores", "legal", "good", "best")))


def from_records(records: list) -> PositionSet:
    """Records ``{"moves", "score", "move_scores": {"1".."7": int|None}}`` -> set.

    Raises ValueError when a record's score is not the max of its move scores
    or a move string does not replay."""
    n = len(records)
    score = np.zeros(n, np.int16)
    ms = np.zeros((n, COLS), np.int16)
    legal = np.zeros((n, COLS), bool)
    for i, r in enumerate(records):
        for c in range(COLS):
            v = r["move_scores"][str(c + 1)]
            if v is not None:
                ms[i, c], legal[i, c] = v, True
        score[i] = r["score"]
        if not legal[i].any() or ms[i][legal[i]].max() != score[i]:
            raise ValueError(f"inconsistent labels for {r['moves']!r}")
    best = legal & (ms == score[:, None])
    good = legal & (np.sign(ms) == np.sign(score)[:, None])
    good = np.where((score < 0)[:, None], best, good)
    moves = [r["moves"] for r in records]
    return PositionSet(moves, encode_batch(moves), score, ms, legal, good, best)


def read_jsonl(path: Path) -> list:
    """Records of a (possibly .gz) JSONL file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_uci(path: Path = UCI_CSV_GZ) -> list:
    """UCI compact CSV (gzip) -> records in the JSONL form (x is to move)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [{"moves": r["moves"], "score": int(r["score"]),
                 "move_scores": {str(c): (int(r[f"s{c}"]) if r[f"s{c}"] else None)
                                 for c in range(1, COLS + 1)}}
                for r in csv.DictReader(f)]


def load_sources(data_dir: Path = DATA_DIR, walks: bool = False) -> dict:
    """All shipped sets by name: 'uci', 'solver', each Pons file name, and
    with ``walks`` 'walks'.

    Returns ``{name: PositionSet}``; 'solver' concatenates every
    ``solver/*.jsonl.gz`` in name order, 'walks' every ``walks/*.jsonl.gz``
    (about 364,000 positions, a few seconds more to load)."""
    out = {"uci": from_records(read_uci(data_dir / "uci" / "connect-4.shared90.csv.gz"))}
    dirs = ("solver", "walks") if walks else ("solver",)
    for name in dirs:
        files = sorted((data_dir / name).glob("*.jsonl.gz"))
        out[name] = from_records([r for p in files for r in read_jsonl(p)])
    for name in TRAIN_PONS + BENCHMARK_PONS:
        out[name] = from_records(read_jsonl(data_dir / "pons" / f"{name}.jsonl"))
    return out


def canonical_keys(boards: np.ndarray) -> list:
    """bytes per board, equal for a position and its mirror image.

    The planes are relative to the side to move, whose identity follows from
    the stone count, so the key identifies the position."""
    flipped = mirror(boards)
    return [min(a.tobytes(), b.tobytes()) for a, b in zip(boards, flipped)]


def heldout_mask(boards: np.ndarray, seed: int, percent: int = 10) -> np.ndarray:
    """bool [N]: a seeded ~``percent`` % of positions held out from training.

    Decided per position by a keyed hash of its canonical key, so mirror twins
    and the same position in two sources always fall on the same side, and
    the split does not depend on file order."""
    salt = str(seed).encode()
    return np.array([
        int.from_bytes(hashlib.blake2b(k, digest_size=8, key=salt).digest(), "little") % 100 < percent
        for k in canonical_keys(boards)], dtype=bool)


def child_values(s: PositionSet) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every unfinished position one legal move after a position of ``s``,
    with its exact value: the negated sign of that move's score (the child's
    side to move is the parent's opponent).

    Returns:
        boards uint8 [M, 2, 6, 7] (the model's encoding, the child's side to
        move first), value float32 [M] (+1 win / 0 draw / -1 loss for it),
        parent int64 [M] (the row of ``s`` it comes from). Children that end
        the game (a four, or a full board) are left out: a search knows those.
    """
    rows, cols = np.nonzero(s.legal)
    child = connect4.play(connect4.take(connect4.from_observation(s.boards), rows), cols)
    keep = np.flatnonzero(~connect4.is_terminal(child))
    value = -np.sign(s.move_scores[rows, cols]).astype(np.float32)
    return connect4.observation(connect4.take(child, keep)), value[keep], rows[keep].astype(np.int64)

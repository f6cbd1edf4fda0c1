"""The validation openings: positions to choose a value network by its search.

    python -m training.validation_openings \
        --out data/connect4/validation/openings_05-14.jsonl

A network is judged by the moves the search plays with it, and a choice made
on the Pons sets would tune on the test sets. These positions are drawn from
the random walks' held-out 10 % instead (``connect4_data.heldout_mask`` with
the training script's seed), so no network trained by
``train_connect4_value`` with that seed has seen them or the positions one
move after them (``split_sources`` drops those). Drawn from the walks files
of 5-14 stones that existed when the set was made (``SOURCES``), so later
files leave it as it is. Kept: 5-14 stones (the
openings, where the search is weakest), not lost for the side to move, and
with at least one legal move that gives the result away (else every move is
right). A seeded sample of ``--count`` in random order, written as labelled
JSONL (``tandem.positions.load_set`` reads it; format in ``data/README.md``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .connect4_data import WALKS_DIR, from_records, heldout_mask, read_jsonl

SPLIT_SEED = 1995  # train_connect4_value's default --seed: its held-out 10 %
STONES = (5, 14)
SOURCES = ("walks_05-11.jsonl.gz", "walks_12-17.jsonl.gz", "walks_more_12-14.jsonl.gz")  # in data/connect4/walks


def validation_openings(count: int, seed: int, split_seed: int = SPLIT_SEED, stones: tuple = STONES) -> list[dict]:
    """``count`` labelled records ({"moves", "score", "move_scores",
    "best_moves"}, 1-indexed columns) from the held-out walks (see the module
    docstring), in a random order fixed by ``seed``.

    Raises:
        ValueError: fewer than ``count`` such positions."""
    s = from_records([r for name in SOURCES for r in read_jsonl(WALKS_DIR / name)])
    n = np.array([len(m) for m in s.moves])
    pick = (heldout_mask(s.boards, split_seed) & (n >= stones[0]) & (n <= stones[1]) & (s.score >= 0)
            & (s.legal & ~s.good).any(axis=1))
    rows = np.flatnonzero(pick)
    if len(rows) < count:
        raise ValueError(f"only {len(rows)} held-out openings qualify, asked for {count}")
    rows = np.random.default_rng(seed).permutation(rows)[:count]
    return [{"moves": s.moves[i], "score": int(s.score[i]),
             "move_scores": {str(c + 1): int(s.move_scores[i, c]) if s.legal[i, c] else None for c in range(7)},
             "best_moves": [c + 1 for c in range(7) if s.best[i, c]]} for i in rows]


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261201, help="the sample's order")
    args = parser.parse_args(argv)
    records = validation_openings(args.count, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {args.out}: {len(records)} positions")
    return 0


if __name__ == "__main__":
    sys.exit(main())

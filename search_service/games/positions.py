"""A game folder's position set: positions to search in ``tandem play --game``.

The file (game.yaml's ``positions``) is JSON lines, one position a line::

    {"moves": "f5d6c3", "plies": 3}

``moves`` is the position's move string from the start in the game's
notation; ``plies`` its moves. A record may also carry an exact solver's
labels, ``score`` and ``move_scores`` (search_service/games/endgames.py),
which ``tandem play`` scores the search's moves against. The bundled sets were made by this module's
command, from the game's own rules and nothing else (so they are free of any
licence), with its defaults::

    python -m search_service.games.positions search_service/games/othello
    python -m search_service.games.positions search_service/games/gomoku

Each position is the end of a uniformly random game (every legal move
equally likely, NumPy's PCG64 generator seeded by ``--seed``) cut after a
number of plies drawn uniformly from ``--min-plies`` to ``--max-plies``
(default: up to half the game's ``max_moves``); finished positions and
repeats are drawn again.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from search_service.games.plugin import GameError, GamePlugin, load_game

DEFAULT_FILE = "positions.jsonl"


def random_positions(game: GamePlugin, count: int, seed: int, min_plies: int = 2,
                     max_plies: int | None = None) -> list[dict]:
    """``count`` distinct unfinished positions of ``game``, as the file's
    records (module docstring), in the order drawn.

    Raises:
        ValueError: a ply range that is empty or outside ``0 .. max_moves - 1``.
    """
    rules, top = game.rules, game.meta.max_moves - 1
    max_plies = top // 2 if max_plies is None else max_plies
    if not 0 <= min_plies <= max_plies <= top:
        raise ValueError(f"plies must satisfy 0 <= min ({min_plies}) <= max ({max_plies}) <= {top}")
    rng = np.random.default_rng(seed)
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < count:
        plies = int(rng.integers(min_plies, max_plies + 1))
        state, actions = rules.initial(1), []
        for _ in range(plies):
            legal = np.flatnonzero(rules.legal_mask(state)[0])
            if legal.size == 0:
                break
            actions.append(int(rng.choice(legal)))
            state = rules.step(state, np.array(actions[-1:], np.int64))[0]
        moves = rules.moves_to_text(actions)
        if len(actions) == plies and not rules.is_terminal(state)[0] and moves not in seen:
            seen.add(moves)
            out.append({"moves": moves, "plies": plies})
    return out


def read_records(path: Path) -> list[dict]:
    """The records of a position set file: ``{"moves": str}``, and where the
    record is labelled ``"score"`` (-1, 0 or 1) and ``"move_scores"`` (action
    int -> -1, 0 or 1).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a record with a string ``moves``, or
            whose labels are malformed (the line named).
    """
    out = []
    with Path(path).open() as f:
        for i, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                moves = rec["moves"]
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not a position record ({exc})") from None
            if not isinstance(moves, str):
                raise ValueError(f"{path}:{i}: moves must be a string, got {type(moves).__name__}")
            out.append({"moves": moves, **_labels(rec, f"{path}:{i}")})
    return out


def _labels(rec: dict, where: str) -> dict:
    if "score" not in rec and "move_scores" not in rec:
        return {}
    results = (-1, 0, 1)
    try:
        score, scores = rec["score"], {int(a): v for a, v in rec["move_scores"].items()}
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: labels need score and move_scores {{action: result}} ({exc})") from None
    if score not in results or any(v not in results for v in scores.values()):
        raise ValueError(f"{where}: a result must be -1, 0 or 1 (score {score!r}, move_scores {scores!r})")
    return {"score": score, "move_scores": scores}


def read_positions(path: Path) -> list[str]:
    """The move strings of a position set file (:func:`read_records` raises)."""
    return [r["moves"] for r in read_records(path)]


def main(argv: list[str] | None = None) -> int:
    """Writes a game folder's position set (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m search_service.games.positions", description=main.__doc__)
    p.add_argument("folder", help="the game folder")
    p.add_argument("--count", type=int, default=300, help="positions (default 300)")
    p.add_argument("--seed", type=int, default=42, help="the generator's seed (default 42)")
    p.add_argument("--min-plies", type=int, default=2, help="fewest moves played (default 2)")
    p.add_argument("--max-plies", type=int, default=None, help="most moves played (default max_moves // 2)")
    p.add_argument("--out", default=DEFAULT_FILE, help=f"file name in the folder (default {DEFAULT_FILE})")
    args = p.parse_args(argv)
    try:
        game = load_game(args.folder)
        records = random_positions(game, args.count, args.seed, args.min_plies, args.max_plies)
    except (GameError, ValueError) as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 1
    path = game.meta.folder / args.out
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{path}: {len(records)} positions of {game.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

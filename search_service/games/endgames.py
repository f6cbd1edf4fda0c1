"""A game folder's endgames: positions near the end of a game, each labelled
with its exact result by OpenSpiel's solver, to score a search's moves
against (``tandem play --game NAME --positions endgames.jsonl`` reports the
share of moves that keep the exact result, ``optimal_move_rate``).

A record is a position set's record (search_service/games/positions.py) with
the labels::

    {"moves": "f5d6...", "plies": 50, "score": 1, "move_scores": {"19": 1, "26": -1}}

``score`` is the exact result for the side to move with best play by both
sides: 1 a win, 0 a draw, -1 a loss; ``move_scores`` the same for each legal
action (the game's own action number, as a string key): the result the side
to move gets by playing it and then playing best. A move *keeps the result*
where its score equals ``score``.

Positions: the state ``k`` plies before the end of a uniformly random game
(every legal move equally likely, NumPy's PCG64 seeded by ``--seed``), ``k``
drawn uniformly from ``--min-left`` to ``--max-left``; a position is kept
where the choice matters (some legal move does not keep the result) and
OpenSpiel's ``alpha_beta_search`` (open_spiel.python.algorithms.minimax:
alpha-beta over the game's OpenSpiel rules, Knuth & Moore 1975) solves every
move to the end of the game within ``--max-depth`` plies (else drawn again:
the labels are exact or the position is not in the set). Finished positions
and repeats are drawn again. The game folder needs game.yaml's ``openspiel``.

    python -m search_service.games.endgames search_service/games/othello

makes the bundled Othello set with the defaults (100 positions, 8 to 12
plies before the end; under a minute on one core). Gomoku has none: its random games end with five in a
row at a median of 113 of 225 plies, and the solver cannot finish a
position with a hundred empty points.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from search_service.games.plugin import GameError, GamePlugin, load_game

DEFAULT_FILE = "endgames.jsonl"


class Unsolved(Exception):
    """The solver did not reach every line's end within its depth."""


def _openspiel_state(game: GamePlugin, ospiel_game, actions: list[int]):
    state = ospiel_game.new_initial_state()
    for a in actions:
        state.apply_action(int(game.rules.to_openspiel_action(a)))
    return state


def _exact(ospiel_game, state, player: int, max_depth: int) -> int:
    """The exact result (-1, 0, 1) of ``state`` for ``player`` with best play.

    Raises:
        Unsolved: a line longer than ``max_depth`` plies.
    """
    from open_spiel.python.algorithms import minimax

    if state.is_terminal():
        return int(np.sign(state.returns()[player]))
    try:
        value, _ = minimax.alpha_beta_search(ospiel_game, state, maximum_depth=max_depth,
                                             maximizing_player_id=player)
    except NotImplementedError as exc:  # the depth ran out with no value function: not exact
        raise Unsolved(str(exc)) from None
    return int(np.sign(value))


def label(game: GamePlugin, actions: list[int], max_depth: int, ospiel_game=None) -> dict:
    """The labels of the position ``actions`` reach: ``{"score", "move_scores"}``
    (module docstring; move_scores keyed by the action as a string).

    Raises:
        Unsolved: some move's lines go past ``max_depth`` plies.
        GameError: game.yaml has no ``openspiel``.
    """
    import pyspiel

    if game.meta.openspiel is None:
        raise GameError(game.meta.label, "endgames are labelled by OpenSpiel's solver: game.yaml names no openspiel")
    ospiel_game = ospiel_game or pyspiel.load_game(game.meta.openspiel)
    state = _openspiel_state(game, ospiel_game, actions)
    mover = state.current_player()
    legal = np.flatnonzero(game.rules.legal_mask(game.rules.parse_moves(game.rules.moves_to_text(actions)))[0])
    scores = {str(int(a)): _exact(ospiel_game, state.child(int(game.rules.to_openspiel_action(int(a)))), mover,
                                  max_depth - 1)
              for a in legal}
    return {"score": max(scores.values()), "move_scores": scores}


def endgame_positions(game: GamePlugin, count: int, seed: int, min_left: int = 8, max_left: int = 12,
                      max_depth: int = 30, attempts: int | None = None) -> list[dict]:
    """``count`` distinct labelled positions of ``game``, ``min_left`` to
    ``max_left`` plies before a random game's end (module docstring).

    Raises:
        ValueError: an empty or negative range, or no solvable position in
            ``attempts`` draws (default 50 a position asked).
        GameError: game.yaml has no ``openspiel``.
    """
    import pyspiel

    if not 1 <= min_left <= max_left:
        raise ValueError(f"plies left must satisfy 1 <= min ({min_left}) <= max ({max_left})")
    if game.meta.openspiel is None:
        raise GameError(game.meta.label, "endgames are labelled by OpenSpiel's solver: game.yaml names no openspiel")
    ospiel_game = pyspiel.load_game(game.meta.openspiel)
    rules, rng = game.rules, np.random.default_rng(seed)
    out: list[dict] = []
    seen: set[str] = set()
    attempts = 50 * count if attempts is None else attempts
    for _ in range(attempts):
        if len(out) == count:
            break
        state, actions = rules.initial(1), []
        while not rules.is_terminal(state)[0]:
            actions.append(int(rng.choice(np.flatnonzero(rules.legal_mask(state)[0]))))
            state = rules.step(state, np.array(actions[-1:], np.int64))[0]
        cut = len(actions) - int(rng.integers(min_left, max_left + 1))
        moves = rules.moves_to_text(actions[:cut])
        if cut < 0 or moves in seen:
            continue
        seen.add(moves)
        try:
            labels = label(game, actions[:cut], max_depth, ospiel_game)
        except Unsolved:
            continue
        if len(set(labels["move_scores"].values())) > 1:  # every move the same result: nothing to score
            out.append({"moves": moves, "plies": cut, **labels})
    if len(out) < count:
        raise ValueError(f"game {game.name}: {len(out)} of {count} positions solved within {max_depth} plies in "
                         f"{attempts} random games")
    return out


def main(argv: list[str] | None = None) -> int:
    """Writes a game folder's endgame set (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m search_service.games.endgames", description=main.__doc__)
    p.add_argument("folder", help="the game folder")
    p.add_argument("--count", type=int, default=100, help="positions (default 100)")
    p.add_argument("--seed", type=int, default=7, help="the generator's seed (default 7)")
    p.add_argument("--min-left", type=int, default=8, help="fewest plies before the random game's end (default 8)")
    p.add_argument("--max-left", type=int, default=12, help="most plies before the random game's end (default 12)")
    p.add_argument("--max-depth", type=int, default=30, help="the solver's plies (default 30)")
    p.add_argument("--out", default=DEFAULT_FILE, help=f"file name in the folder (default {DEFAULT_FILE})")
    args = p.parse_args(argv)
    try:
        game = load_game(args.folder)
        records = endgame_positions(game, args.count, args.seed, args.min_left, args.max_left, args.max_depth)
    except (GameError, ValueError) as exc:
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 1
    path = Path(game.meta.folder) / args.out
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{path}: {len(records)} endgame positions of {game.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

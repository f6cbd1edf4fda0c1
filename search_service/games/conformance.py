"""The conformance kit of a game plug-in, CPU part.

    python -m search_service.games.conformance FOLDER [--games N] [--seed S] [--single-games K]

FOLDER is a game folder (or the name of a bundled game, ``othello`` or ``gomoku``). The kit
loads it (:func:`~search_service.games.plugin.load_game`) and plays N random
games with its NumPy rules, all in one batch, choosing every action uniformly
among the legal ones. At every ply it checks:

* the rules against themselves: legal actions exist exactly where the game is
  not over; ``step``'s terminal flag is ``is_terminal`` of the next state, its
  reward is 0 where the game goes on and ``-returns`` of the next state where
  it ended; no game outlasts ``max_moves``; and, in the first K games,
  ``step`` raises ValueError on an illegal action and after the end, and the
  finished game's move string reads back (``parse_moves(moves_to_text(...))``)
  to its state. After the games, every move of those K games, from all
  plies, is shuffled into one batch: each function on that batch must give,
  row by row, what it gives on one state alone;
* the rules against OpenSpiel's (where game.yaml names an ``openspiel`` game
  and pyspiel imports): the same actions are played in pyspiel, and the legal
  action sets (through ``to_openspiel_action``), the terminal flags, the
  player to move and the final returns must agree.

A game that disagrees stops at its first mismatch, and only that one is
reported; the report lists the first few with their move strings. Exit status: 0 conformant, 1 a mismatch, 2 the
folder does not load. The GPU half (:mod:`search_service.games.gpu_conformance`:
random games played with the folder's ``rules.cu`` on the GPU equal the NumPy
rules bit for bit) runs where CuPy sees a GPU and the folder has a rules.cu;
the report says when it was skipped, and why.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from search_service.games.plugin import GameError, GamePlugin, load_game, resolve_folder

SHOWN = 5  # mismatches printed in full
KEPT = 100  # mismatches kept in a report (the count covers them all)
_STATE_FUNCTIONS = ("legal_mask", "is_terminal", "returns", "to_play", "observation")


@dataclass(frozen=True)
class Mismatch:
    """One disagreement: the random game (its index; -1 for the run as a
    whole), the actions played in it so far (the move at fault last, where a
    move was), and what differed."""

    game: int
    ply: int
    moves: str
    what: str

    def __str__(self) -> str:
        if self.game < 0:
            return self.what
        return f"game {self.game}, ply {self.ply} (moves {self.moves or '(none)'}): {self.what}"


@dataclass
class Report:
    """What a kit run compared and found."""

    name: str
    folder: Path
    games: int
    seed: int
    single_games: int
    plies: int = 0  # actions played over all games
    seconds: float = 0.0
    openspiel: str = ""  # what the OpenSpiel part compared, or why it was skipped
    gpu: str = ""  # what the GPU half compared, or why it was skipped ("": not asked for)
    count: int = 0  # mismatches found
    mismatches: list[Mismatch] = field(default_factory=list)  # the first KEPT of them

    @property
    def ok(self) -> bool:
        return self.count == 0

    def add(self, mismatch: Mismatch) -> None:
        self.count += 1
        if len(self.mismatches) < KEPT:
            self.mismatches.append(mismatch)

    def mismatch(self, game: int, ply: int, moves: str, what: str) -> None:
        """Adds a :class:`Mismatch` of these fields (the GPU half's way, which
        imports nothing of this module: it is imported from here)."""
        self.add(Mismatch(game, ply, moves, what))

    def text(self, shown: int = SHOWN) -> str:
        """The report as the command prints it."""
        lines = [
            f"{self.name} ({self.folder}): {self.games} random games (seed {self.seed}), "
            f"{self.plies} plies, {self.seconds:.1f} s",
            f"  rules against themselves: every ply; one state at a time = a shuffled batch of every move "
            f"of the first {min(self.single_games, self.games)} games",
            f"  {self.openspiel}",
            *([f"  {self.gpu}"] if self.gpu else []),
            f"mismatches: {self.count}",
        ]
        lines += [f"  {m}" for m in self.mismatches[:shown]]
        if self.count > shown:
            lines.append(f"  ... and {self.count - shown} more")
        lines.append("OK" if self.ok else "NOT CONFORMANT")
        return "\n".join(lines)


def check_folder(folder: str | Path, games: int = 1000, seed: int = 0, single_games: int = 100,
                 gpu: bool = True) -> Report:
    """Loads ``folder`` (a path, or a bundled game's name) and runs the kit on it.

    Raises:
        GameError: the folder does not load.
    """
    return check_game(load_game(resolve_folder(folder)), games, seed, single_games, gpu)


def check_game(plugin: GamePlugin, games: int = 1000, seed: int = 0, single_games: int = 100,
               gpu: bool = True) -> Report:
    """Runs the kit on a loaded game: ``games`` random games from ``seed``,
    the one-state-at-a-time checks over the first ``single_games`` of them,
    and, with ``gpu``, the GPU half over ``games`` more
    (:func:`~search_service.games.gpu_conformance.gpu_check`: skipped, with
    the reason in the report, without a GPU or a rules.cu).

    Raises:
        ValueError: ``games`` < 1 or ``single_games`` < 0.
    """
    if games < 1 or single_games < 0:
        raise ValueError(f"games must be >= 1 and single_games >= 0, got {games} and {single_games}")
    report = Report(plugin.name, plugin.meta.folder, games, seed, single_games)
    start = time.perf_counter()
    _Run(plugin, report, np.random.default_rng(seed), single_games).play()
    if gpu:
        from search_service.games.gpu_conformance import gpu_check

        gpu_check(plugin, games, seed, report)
    report.seconds = time.perf_counter() - start
    return report


def _openspiel(plugin: GamePlugin, report: Report) -> Any:
    """The pyspiel game to compare with, or None (the reason in ``report.openspiel``)."""
    name = plugin.meta.openspiel
    if not name:
        report.openspiel = "OpenSpiel comparison skipped: game.yaml names no openspiel game"
        return None
    try:
        import pyspiel
    except ImportError:
        report.openspiel = (f"OpenSpiel comparison skipped: pyspiel is not importable "
                            f"(pip install open-spiel) to compare with {name!r}")
        return None
    try:
        game = pyspiel.load_game(name)
    except Exception as e:  # pyspiel.SpielError for an unknown name
        report.openspiel = f"OpenSpiel {name}: cannot be loaded"
        report.add(Mismatch(-1, 0, "", f"openspiel: pyspiel cannot load {name!r}: {e}"))
        return None
    if game.num_players() != plugin.meta.players:
        report.openspiel = f"OpenSpiel {name}: not compared"
        report.add(Mismatch(-1, 0, "", f"openspiel: {name} has {game.num_players()} players, "
                                       f"game.yaml {plugin.meta.players}"))
        return None
    report.openspiel = (f"OpenSpiel {name}: legal actions, terminal flags, player to move and returns "
                        "compared at every ply")
    return game


class _Run:
    """One kit run: the batch of random games and, beside it, pyspiel's."""

    def __init__(self, plugin: GamePlugin, report: Report, rng: np.random.Generator, single_games: int):
        self.rules = plugin.rules
        self.meta = plugin.meta
        self.report = report
        self.rng = rng
        n = report.games
        self.single = np.arange(n) < single_games  # bool [N]: games also checked one state at a time
        # (game, plies before, state uint64 [1, W], action) of every move in those games
        self.samples: list[tuple[int, int, np.ndarray, int]] = []
        self.alive = np.ones(n, np.bool_)  # games neither finished nor failed
        self.failed: set[int] = set()  # games with a mismatch: one is enough
        self.history: list[list[int]] = [[] for _ in range(n)]
        self.spiel_game = _openspiel(plugin, report)
        self.spiel = [self.spiel_game.new_initial_state() for _ in range(n)] if self.spiel_game else None
        self.spiel_of: np.ndarray | None = None  # int64 [A]: OpenSpiel's id of each action

    # -- reporting -------------------------------------------------------

    def fail(self, g: int, what: str, plies: int | None = None) -> None:
        """Records a mismatch in game ``g`` after its first ``plies`` actions
        (default: all so far) and stops that game."""
        actions = self.history[g][:plies]
        try:
            moves = self.rules.moves_to_text(actions)
        except Exception:
            moves = str(actions)  # the notation itself may be what is broken
        self.report.add(Mismatch(g, len(actions), moves, what))
        self.alive[g] = False
        self.failed.add(g)

    def fail_all(self, idx: np.ndarray, bad: np.ndarray, what: Callable[[int], str]) -> None:
        """``fail`` for each game ``idx[k]`` where ``bad[k]``; ``what(k)`` says why."""
        for k in np.flatnonzero(bad):
            self.fail(int(idx[k]), what(int(k)))

    # -- the run ---------------------------------------------------------

    def play(self) -> None:
        n = self.report.games
        try:
            states = self.rules.initial(n)
            if self.spiel is not None:
                self.spiel_of = self._spiel_actions()
            for ply in range(self.meta.max_moves + 1):
                idx = np.flatnonzero(self.alive)
                if idx.size == 0:
                    break
                states[idx] = self._ply(ply, idx, states[idx])
            self._check_mixed_batch()
        except Exception as e:  # a rules function raising on a batch stops the run: report it, not a traceback
            self.report.add(Mismatch(-1, 0, "", f"the run stopped: {type(e).__name__}: {e}"))

    def _spiel_actions(self) -> np.ndarray | None:
        """OpenSpiel's id of every action, or None (recorded) if two actions share one."""
        table = np.array([int(self.rules.to_openspiel_action(a)) for a in range(self.meta.num_actions)], np.int64)
        if np.unique(table).size != table.size:
            self.report.add(Mismatch(-1, 0, "", "openspiel: to_openspiel_action maps two actions to one id"))
            self.spiel = None
            return None
        return table

    def _ply(self, ply: int, idx: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Checks the live games ``idx`` (states ``s``) and plays one random
        action in each unfinished one; the states after it."""
        rules = self.rules
        b, meta = s.shape[0], self.meta
        legal = _kind("legal_mask", rules.legal_mask(s), np.bool_, (b, meta.num_actions))
        terminal = _kind("is_terminal", rules.is_terminal(s), np.bool_, (b,))
        player = _kind("to_play", rules.to_play(s), np.int8, (b,))
        result = _kind("returns", rules.returns(s), np.float32, (b,))
        _kind("observation", rules.observation(s), np.uint8, (b, *meta.observation))
        self.fail_all(idx, terminal & legal.any(axis=1), lambda k: "self: legal actions in a finished game")
        self.fail_all(idx, ~terminal & ~legal.any(axis=1), lambda k: "self: no legal action in a game still going")
        self.fail_all(idx, ~terminal & (result != 0), lambda k: f"self: returns {result[k]} in a game still going")
        self.fail_all(idx, (player != 0) & (player != 1), lambda k: f"self: to_play {player[k]} is no player")
        if ply == self.meta.max_moves:
            self.fail_all(idx, ~terminal, lambda k: f"self: the game goes on after max_moves ({ply}) plies")
        if self.spiel is not None:
            self._compare_spiel(idx, legal, terminal, player, result)
        self.alive[idx[terminal]] = False  # finished games leave the batch

        go = self.alive[idx] & ~terminal  # games that play a move at this ply
        if not go.any():
            return s
        live, s_live, legal_live = idx[go], s[go], legal[go]
        scores = self.rng.random(legal_live.shape)
        scores[~legal_live] = -1.0  # argmax then picks uniformly among the legal actions
        actions = scores.argmax(axis=1).astype(np.int64)
        for k, g in enumerate(live.tolist()):
            self.history[g].append(int(actions[k]))  # before the checks: a mismatch shows the move at fault
        nxt, ended, reward = rules.step(s_live, actions)
        _kind("step's next states", nxt, np.uint64, s_live.shape)
        _kind("step's terminal", ended, np.bool_, (live.size,))
        _kind("step's reward", reward, np.float32, (live.size,))
        self._check_step(live, nxt, ended, reward)
        for k in np.flatnonzero(self.single[live]):
            g = int(live[k])
            self.samples.append((g, len(self.history[g]) - 1, s_live[k:k + 1], int(actions[k])))
            try:
                self._check_alone(g, s_live[k:k + 1], nxt[k:k + 1], ended[k])
            except Exception as e:
                self.fail(g, f"self: one state at a time: {type(e).__name__}: {e}")
        if self.spiel is not None:
            for k, g in enumerate(live.tolist()):
                if self.alive[g]:
                    self.spiel[g].apply_action(int(self.spiel_of[actions[k]]))
        self.report.plies += live.size
        out = s.copy()
        out[go] = nxt
        return out

    def _check_step(self, live: np.ndarray, nxt: np.ndarray, ended: np.ndarray, reward: np.ndarray) -> None:
        """``step``'s flags and rewards against the next states' own view."""
        rules = self.rules
        after, back = rules.is_terminal(nxt), rules.returns(nxt)
        self.fail_all(live, ended != after, lambda k: f"self: step says terminal={ended[k]}, "
                                                      f"is_terminal of the next state {after[k]}")
        self.fail_all(live, ~ended & (reward != 0), lambda k: f"self: reward {reward[k]} for a move that ends nothing")
        self.fail_all(live, ended & (reward != -back), lambda k: f"self: the mover's reward {reward[k]} but "
                                                                 f"returns {back[k]} for the next player")

    def _check_alone(self, g: int, state: np.ndarray, nxt: np.ndarray, ended: bool) -> None:
        """Game ``g``'s state ``state`` (uint64 [1, W]), the move just played
        in it leading to ``nxt``: an illegal action is refused, and where the
        game ended, its move string reads back to ``nxt`` and play stops."""
        rules = self.rules
        illegal = np.flatnonzero(~rules.legal_mask(state)[0])
        if illegal.size and not _raises_value_error(rules.step, state, illegal[:1].astype(np.int64)):
            self.fail(g, f"self: step takes the illegal action {int(illegal[0])} without a ValueError")
        elif ended:
            text = rules.moves_to_text(self.history[g])
            if not _same(rules.parse_moves(text), nxt):
                self.fail(g, f"self: parse_moves({text!r}) is not the state the game reached")
            elif not _raises_value_error(rules.step, nxt, np.zeros(1, np.int64)):
                self.fail(g, "self: step plays on after the game ended without a ValueError")

    def _check_mixed_batch(self) -> None:
        """Every move of the sampled games, from all plies and games, shuffled
        into one batch: each function on it gives, row by row, what it gives
        on one state alone. (The run's own batch cannot show this: its games
        move in step, so its states are alike, e.g. all one player's turn.)"""
        if not self.samples:
            return
        rules = self.rules
        order = self.rng.permutation(len(self.samples))
        samples = [self.samples[i] for i in order]
        states = np.concatenate([state for _, _, state, _ in samples])
        actions = np.array([a for _, _, _, a in samples], np.int64)
        nxt, ended, reward = rules.step(states, actions)
        on_batch = {name: (getattr(rules, name)(states), getattr(rules, name)(nxt)) for name in _STATE_FUNCTIONS}
        for m, (g, plies, state, action) in enumerate(samples):
            if g in self.failed:
                continue
            try:
                one = rules.step(state, actions[m:m + 1])
                if not (_same(one[0], nxt[m:m + 1]) and _same(one[1], ended[m:m + 1])
                        and _same(one[2], reward[m:m + 1])):
                    self.fail(g, f"self: step on one state differs from step on the batch (action {action})",
                              plies + 1)
                    continue
                for name, (before, after) in on_batch.items():
                    fn = getattr(rules, name)
                    if not (_same(fn(state), before[m:m + 1]) and _same(fn(one[0]), after[m:m + 1])):
                        self.fail(g, f"self: {name} on one state differs from {name} on the batch", plies + 1)
                        break
            except Exception as e:
                self.fail(g, f"self: one state at a time: {type(e).__name__}: {e}", plies + 1)

    def _compare_spiel(self, idx: np.ndarray, legal: np.ndarray, terminal: np.ndarray, player: np.ndarray,
                       result: np.ndarray) -> None:
        for k, g in enumerate(idx.tolist()):
            if not self.alive[g]:
                continue
            theirs = self.spiel[g]
            if theirs.is_terminal() != bool(terminal[k]):
                self.fail(g, f"openspiel: terminal {theirs.is_terminal()}, ours {bool(terminal[k])}")
            elif terminal[k]:
                p = int(player[k])
                want = theirs.returns()
                if want[p] != result[k] or want[1 - p] != -result[k]:
                    self.fail(g, f"openspiel: returns {want} (player 0, 1), ours {result[k]} for player {p}")
            elif theirs.current_player() != player[k]:
                self.fail(g, f"openspiel: player {theirs.current_player()} to move, ours {player[k]}")
            else:
                ours = sorted(self.spiel_of[legal[k]].tolist())
                if ours != theirs.legal_actions():
                    self.fail(g, f"openspiel: legal actions {theirs.legal_actions()}, ours {ours} "
                                 "(OpenSpiel's ids)")


def _kind(what: str, value: Any, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` if it is an array of that dtype and shape.

    Raises:
        TypeError: it is not (the run stops there: nothing after it can be compared).
    """
    if not (isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == shape):
        got = f"{value.dtype.name} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__
        raise TypeError(f"{what} returned {got}, expected {np.dtype(dtype).name} {list(shape)}")
    return value


def _same(a: Any, b: np.ndarray) -> bool:
    a = np.asarray(a)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.all(a == b))


def _raises_value_error(fn: Callable, *args) -> bool:
    try:
        fn(*args)
    except ValueError:
        return True
    return False


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The kit's options (this module's command and ``tandem check-game``)."""
    ap.add_argument("folder", help="a game folder, or the name of a bundled game (othello, gomoku)")
    ap.add_argument("--games", type=int, default=10_000, help="random games to play (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--single-games", type=int, default=100,
                    help="games also checked one state at a time (default 100)")
    ap.add_argument("--no-gpu", action="store_true",
                    help="skip the GPU half (random games with the folder's rules.cu on the GPU)")


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs the kit for parsed ``args``; prints its report. Returns the exit
    status: 0 conformant, 1 a mismatch, 2 the folder does not load."""
    if args.games < 1 or args.single_games < 0:
        ap.error("--games must be >= 1 and --single-games >= 0")
    try:
        report = check_folder(args.folder, args.games, args.seed, args.single_games, not args.no_gpu)
    except GameError as e:
        print(e, file=sys.stderr)
        return 2
    print(report.text())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m search_service.games.conformance",
                                 description="Checks a game folder's NumPy rules against themselves and OpenSpiel.")
    add_arguments(ap)
    return run(ap, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

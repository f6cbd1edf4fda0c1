"""Match play: each game of the search service against OpenSpiel's MCTS bot.

tandem plays through a real ``tandem up`` stack on loopback
(bench/loopback_stack.py): one ``Search`` a move over gRPC, with the frame
(``--frame-ms``, 16 ms) as its ``deadline_ms``, the game's moves so far as
its move string and one session a game (the tree is kept between moves).
The opponent is OpenSpiel's C++ MCTS bot (``pyspiel.MCTSBot``: UCT with
``uct_c`` 2, the random-rollout evaluator with one rollout a leaf, the
solver on, ``--simulations`` 10,000 a move, no time limit), in this process
on the host's CPU. The colours alternate: tandem moves first in the even
games. A game is played in OpenSpiel (its rules decide the result); tandem's
actions become OpenSpiel's through the game folder's ``to_openspiel_action``.

One row per game: ``game``, ``opponent``, ``games``, ``wins`` / ``draws`` /
``losses`` (tandem's), ``points_share`` (wins + half the draws, over
games), ``ms_per_move`` (the mean wall time of tandem's ``Search`` calls,
client side) and its p99, ``simulations_per_move`` (mean), the backend that
searched and the bot's settings. A game whose folder has labelled endgames
(game.yaml's ``endgames``, search_service/games/endgames.py) adds a row
with ``opponent`` ``exact_endgames_openspiel_alpha_beta``: one fresh search
a position, ``optimal_move_rate`` (over the positions not lost, the share of
moves that keep the exact result), ``best_score_move_rate``, ``positions``.
The file's header has the GPU, the host CPU,
the versions, the date, the commit, whether the tree was clean and the exact
command (bench/common.py). ``--games 4`` is a smoke test; the issue's
figure is ``--games 200`` on the GPU machine.

    python -m bench.games --games 200                    # both bundled games, 200 each
    python -m bench.games --games 4 --game othello --out /tmp/games

The opponent needs OpenSpiel (``pip install 'tandem[bench]'``, or the test extra).
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
from tandem.v1 import search_pb2, search_pb2_grpc

from bench.common import make_parser, note, print_rows, progress, write_results
from bench.loopback_stack import loopback_stack
from search_service.games.plugin import load_game, resolve_folder
from stack.stats import percentiles
from tandem.server import channel

BENCHMARK = "games"
UCT_C = 2.0  # OpenSpiel's examples' exploration constant for MCTSBot
MAX_MEMORY_MB = 1000  # the bot's tree
COLUMNS = ("game", "opponent", "games", "wins", "draws", "losses", "points_share", "positions", "optimal_move_rate",
           "ms_per_move", "simulations_per_move", "backend")


class Tandem:
    """tandem's side of a match: one Search a move through the stack's search
    service, in the game's notation; the OpenSpiel action of its answer."""

    def __init__(self, stub, folder: str, frame_ms: float):
        self.stub = stub
        self.plugin = load_game(resolve_folder(folder))
        rules = self.plugin.rules
        self.to_openspiel = [int(rules.to_openspiel_action(a)) for a in range(self.plugin.meta.num_actions)]
        self.from_openspiel = {o: a for a, o in enumerate(self.to_openspiel)}
        self.frame_ms = frame_ms
        self.ms: list[float] = []
        self.simulations: list[int] = []
        self.backends: set[str] = set()

    def search(self, moves: str, session: str, seed: int) -> int:
        """tandem's action (its own numbering) in the position of the move string ``moves``."""
        request = search_pb2.SearchRequest(game=self.plugin.name, moves=moves, deadline_ms=self.frame_ms,
                                           session_id=session, seed=seed)
        start = time.perf_counter()
        reply = self.stub.Search(request, timeout=max(10 * self.frame_ms / 1000.0, 5.0))
        self.ms.append((time.perf_counter() - start) * 1e3)
        self.simulations.append(reply.simulations)
        self.backends.add(reply.backend)
        return reply.action

    def move(self, actions: list[int], session: str, seed: int) -> int:
        """The OpenSpiel action tandem plays after ``actions`` (its own numbering)."""
        return self.to_openspiel[self.search(self.plugin.rules.moves_to_text(actions), session, seed)]


def play_match(tandem: Tandem, games: int, simulations: int, seed: int) -> dict:
    """``games`` games of tandem against the MCTS bot, colours alternating; the row."""
    import pyspiel

    game = pyspiel.load_game(tandem.plugin.meta.openspiel)
    points = {1.0: 0, 0.0: 0, -1.0: 0}
    for i in range(games):
        bot = pyspiel.MCTSBot(game, pyspiel.RandomRolloutEvaluator(1, seed + i), UCT_C, simulations, MAX_MEMORY_MB,
                              True, seed + i, False)
        state, actions, ours = game.new_initial_state(), [], i % 2
        session = f"bench-{uuid.uuid4()}"
        while not state.is_terminal():
            if state.current_player() == ours:
                action = tandem.move(actions, session, seed * 1_000_003 + len(actions) + 1)
            else:
                action = bot.step(state)
            actions.append(tandem.from_openspiel[action])
            state.apply_action(action)
        result = float(np.sign(state.returns()[ours]))
        points[result] += 1
        note(f"{tandem.plugin.name} game {i + 1}/{games}: tandem {'first' if ours == 0 else 'second'}, "
             f"{ {1.0: 'won', 0.0: 'drew', -1.0: 'lost'}[result]} in {len(actions)} plies")
    return {
        "game": tandem.plugin.name,
        "opponent": f"openspiel_mcts_random_rollout_{simulations}",
        "games": games,
        "wins": points[1.0],
        "draws": points[0.0],
        "losses": points[-1.0],
        "points_share": round((points[1.0] + 0.5 * points[0.0]) / games, 4),
        "ms_per_move": round(float(np.mean(tandem.ms)), 3),
        "ms_per_move_p99": round(percentiles(tandem.ms, 99)[0], 3),
        "simulations_per_move": round(float(np.mean(tandem.simulations)), 1),
        "tandem_moves": len(tandem.ms),
        "frame_ms": tandem.frame_ms,
        "backend": ",".join(sorted(tandem.backends)),
        "opponent_settings": {"bot": "pyspiel.MCTSBot", "evaluator": "RandomRolloutEvaluator(n_rollouts=1)",
                              "uct_c": UCT_C, "max_simulations": simulations, "solve": True,
                              "max_wall_clock_time": None},
    }


def score_endgames(tandem: Tandem, path, seed: int) -> dict:
    """One ``Search`` (fresh tree, the frame as its deadline) of each position
    of a labelled endgame set (search_service/games/endgames.py); the row:
    ``optimal_move_rate``, over the positions the side to move does not
    lose, the share of moves that keep the exact result, and
    ``best_score_move_rate`` over all positions."""
    from search_service.games.positions import read_records
    from tandem.positions import LabelledPosition

    kept = not_lost = best = 0
    records = read_records(path)
    for i, rec in enumerate(records):
        pos = LabelledPosition(rec["moves"], rec["score"], rec["move_scores"], f"{path}:{i + 1}")
        action = tandem.search(rec["moves"], "", seed + i)
        best += pos.is_best(action)
        if pos.score >= 0:
            not_lost += 1
            kept += pos.keeps_result(action)
    return {
        "game": tandem.plugin.name,
        "opponent": "exact_endgames_openspiel_alpha_beta",
        "games": None,  # not a match: one search a position
        "points_share": None,
        "positions": len(records),
        "positions_not_lost": not_lost,
        "optimal_move_rate": round(kept / not_lost, 4) if not_lost else None,
        "best_score_move_rate": round(best / len(records), 4),
        "ms_per_move": round(float(np.mean(tandem.ms)), 3),
        "ms_per_move_p99": round(percentiles(tandem.ms, 99)[0], 3),
        "simulations_per_move": round(float(np.mean(tandem.simulations)), 1),
        "frame_ms": tandem.frame_ms,
        "backend": ",".join(sorted(tandem.backends)),
        "opponent_settings": {"solver": "open_spiel.python.algorithms.minimax.alpha_beta_search",
                              "set": Path(path).name},
    }


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--game", action="append", help="a game folder or bundled game (repeatable; "
                                                        "default: othello and gomoku)")
    parser.add_argument("--games", type=int, default=200, help="games per game, colours alternating (default 200)")
    parser.add_argument("--simulations", type=int, default=10_000, help="the bot's simulations a move (default 10000)")
    parser.add_argument("--frame-ms", type=float, default=16.0, help="tandem's deadline a move (default 16)")
    parser.add_argument("--seed", type=int, default=1, help="seeds of the bots and of tandem's searches")
    args = parser.parse_args()
    folders = args.game or ["othello", "gomoku"]
    games = [str(resolve_folder(f)) for f in folders]
    backend = {"cpu": "cpu", "cpu_reference": "cpu", "gpu": "cuda", "gpu_warp_aggregated": "cuda",
               "gpu_global_atomic": "cuda"}.get(args.backend or "all", "auto")  # the stack's search.backend
    if args.quick:
        args.games, args.simulations, backend = min(args.games, 2), min(args.simulations, 200), "cpu"
    rows = []
    with loopback_stack({"search": {"backend": backend, "games": games}}) as (cfg, _):
        with channel(cfg.search.address, cfg) as ch:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            for folder in games:
                row = play_match(Tandem(stub, folder, args.frame_ms), args.games, args.simulations, args.seed)
                progress(row)
                rows.append(row)
                endgames = load_game(folder).meta.endgames
                if endgames is not None:  # positions labelled by an exact solver
                    row = score_endgames(Tandem(stub, folder, args.frame_ms), endgames, args.seed)
                    progress(row)
                    rows.append(row)
    write_results(BENCHMARK, rows, args.out)
    print_rows(rows, COLUMNS)


if __name__ == "__main__":
    main()

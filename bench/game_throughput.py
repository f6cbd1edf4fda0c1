"""Rollout simulations per second of the CUDA search over a batch of trees,
per game (issue 42's targets on the H200: Othello >= 20 M/s, Gomoku >= 5 M/s,
Connect Four unchanged).

    python -m bench.game_throughput [--games connect4,othello,gomoku] [--trees 1024]
        [--simulations 1000] [--parallel 16] [--sims-per-warp 1] [--repeats 5]

Each game: ``trees`` searches of its starting position, ``simulations``
rollout simulations each, K = ``parallel`` in flight per tree, through
``CudaBackend.search`` (Connect Four: its own kernels; a game folder: its
module, search_service/cuda/game_batch.py); the best of ``repeats`` timed
calls after one warm-up call (which compiles). Writes
bench/results/game_throughput.json (bench/common.py) with one row per game:
wall-clock simulations/s of the whole call (set-up, launches, copies back included).
Needs a GPU.
"""
from __future__ import annotations

import time

import numpy as np

from bench.common import attempt, finish, make_parser


def _roots(name: str, trees: int):
    from search_service.games import connect4
    from search_service.games.plugin import bundled_folder, load_game
    from search_service.mcts.games import CONNECT_FOUR, PluginSearch

    if name == "connect4":
        return CONNECT_FOUR, connect4.stack([connect4.parse_moves("")] * trees)
    game = PluginSearch(load_game(bundled_folder(name)))
    return game, game.rules.initial(trees)


def measure(name: str, trees: int, simulations: int, parallel: int, sims_per_warp: int, repeats: int) -> dict:
    """One game's row: simulations/s (best of ``repeats``) and the call's ms."""
    import cupy

    from search_service.cuda import CudaBackend
    from search_service.mcts.backend import SearchParams

    game, roots = _roots(name, trees)
    backend = CudaBackend(sims_per_warp=sims_per_warp)
    params = SearchParams(simulations=simulations, deadline_ms=None, parallel_sims=parallel,
                          max_nodes=simulations + 8, seed=1, game=game)
    backend.search(roots, params)  # compiles the module, warms the pools
    best = float("inf")
    for _ in range(repeats):
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        results, _ = backend.search(roots, params)
        best = min(best, time.perf_counter() - t)
    done = sum(r.simulations for r in results)
    return {"game": name, "trees": trees, "simulations_per_tree": simulations, "parallel_sims": parallel,
            "sims_per_warp": sims_per_warp, "ms": round(best * 1e3, 3),
            "simulations_per_s": round(done / best), "mean_depth": float(np.mean([r.max_depth for r in results]))}


def main(argv: list[str] | None = None) -> int:
    ap = make_parser(__doc__)
    ap.add_argument("--games", default="connect4,othello,gomoku")
    ap.add_argument("--trees", type=int, default=1024)
    ap.add_argument("--simulations", type=int, default=1000)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--sims-per-warp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows = []
    for g in args.games.split(","):
        row = attempt(g, measure, g, args.trees, args.simulations, args.parallel, args.sims_per_warp, args.repeats)
        if row is not None:
            rows.append(row)
    finish("game_throughput", rows, args.out, ("game", "simulations_per_s", "ms", "trees", "parallel_sims",
                                               "sims_per_warp"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

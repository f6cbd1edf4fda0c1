"""search_quality: how often the search's move keeps the solver's result.

Position sets: ``Test_L3_R1`` and ``Test_L2_R1`` (Pons' test positions with
exact solver scores, bundled in ``data/connect4/pons``; see
``tandem.positions``). Only positions NOT lost for the side to move count
(score >= 0): ``optimal_move_rate`` is the share of them where the chosen move
keeps the solver's result (a win stays a win, a draw a draw:
``LabelledPosition.keeps_result``). ``positions`` is how many were scored.
Random rollouts (UCT), ``--parallel-sims`` (16) simulations in flight per tree.

Two kinds of row:

* equal simulations (``simulations`` set, ``budget_ms`` null): every position
  of the set searched as one batch of trees in a single call, ``--simulations``
  1000 and 10000 per tree, for the CPU reference and the GPU
  (``--gpu-variant``, default gpu_warp_aggregated). With the same Philox seed
  the two should agree exactly;
* frame budget (``budget_ms`` = 16, ``simulations`` null): each position
  searched as its OWN request (one tree, ``deadline_ms=16``, no simulation
  cap), as the serving path does; GPU with ``--deadline-parallel-sims`` (256)
  simulations in flight, the CPU reference with ``--parallel-sims``. The
  deadline is checked between waves, so a call can overrun it by one wave:
  the rows also give the calls' latency_ms_p50 / p99 and simulations_mean.

Row fields: position_set, backend, budget_ms, simulations, positions,
optimal_move_rate, plus parallel_sims, seconds (wall-clock of the set),
and for frame-budget rows simulations_mean, latency_ms_p50, latency_ms_p99.

Command (full): ``python3 -m bench.search_quality``
Smoke test:     ``python3 -m bench.search_quality --quick``
"""
from __future__ import annotations

import time

import numpy as np

from bench import common
from stack.stats import percentiles

BENCHMARK = "search_quality"


def scored_positions(name: str, limit: int | None):
    """(labelled positions not lost for the side to move, their batch)."""
    from tandem.positions import load_set

    recs = [r for r in load_set(name) if r.score >= 0][:limit]
    return recs, common.positions([r.moves for r in recs])


def rate(recs, actions) -> float:
    return float(np.mean([r.keeps_result(int(a)) for r, a in zip(recs, actions)]))


def missed(recs, actions) -> list[str]:
    """The move strings (1-indexed columns) of the positions whose chosen move
    (``actions``: 0-indexed columns) gives the result away: which positions a
    rate's misses are, to compare runs position by position."""
    return [r.moves for r, a in zip(recs, actions) if not r.keeps_result(int(a))]


def played(recs, actions) -> dict[str, int]:
    """For each missed position (its move string), the column it played
    (1-indexed): to tell two searches' misses of one position apart."""
    return {r.moves: int(a) + 1 for r, a in zip(recs, actions) if not r.keeps_result(int(a))}


def equal_simulations(variant: str, set_name: str, recs, roots, sims: int, k: int) -> dict | None:
    """One batched call over the whole set at ``sims`` simulations per tree."""
    params = common.search_params(simulations=sims, parallel_sims=k, evaluator="rollout", max_nodes=sims + 1)
    if params is None:
        return None
    backend = common.make_backend(variant)
    t = time.perf_counter()
    results, _ = backend.search(roots, params)
    common.sync_cuda()
    seconds = time.perf_counter() - t
    return dict(
        position_set=set_name,
        backend=variant,
        budget_ms=None,
        simulations=sims,
        positions=len(recs),
        optimal_move_rate=rate(recs, [r.action for r in results]),
        parallel_sims=k,
        seconds=seconds,
    )


def frame_budget(variant: str, set_name: str, recs, roots, budget_ms: float, k: int) -> dict | None:
    """Each position its own request with a ``budget_ms`` deadline."""
    from search_service.games import connect4

    params = common.search_params(simulations=None, deadline_ms=budget_ms, parallel_sims=k, evaluator="rollout")
    if params is None:
        return None
    backend = common.make_backend(variant)
    backend.search(connect4.take(roots, 0), params)  # warm-up (kernel compilation)
    common.sync_cuda()
    actions, sims, ms = [], [], []
    t0 = time.perf_counter()
    for i in range(len(recs)):
        t = time.perf_counter()
        (res,), _ = backend.search(connect4.take(roots, i), params)
        common.sync_cuda()
        ms.append((time.perf_counter() - t) * 1e3)
        actions.append(res.action)
        sims.append(res.simulations)
    p50, p99 = percentiles(ms, 50, 99)
    return dict(
        position_set=set_name,
        backend=variant,
        budget_ms=budget_ms,
        simulations=None,
        positions=len(recs),
        optimal_move_rate=rate(recs, actions),
        parallel_sims=k,
        seconds=time.perf_counter() - t0,
        simulations_mean=float(np.mean(sims)),
        latency_ms_p50=p50,
        latency_ms_p99=p99,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.make_parser(__doc__)
    parser.add_argument("--sets", default="Test_L3_R1,Test_L2_R1", help="comma list of bundled position sets")
    parser.add_argument("--limit", type=int, default=None, help="first N scored positions per set (default all; quick 12)")
    parser.add_argument("--simulations", type=common.int_list, default=None, help="equal-simulation budgets (default 1000,10000; quick 50)")
    parser.add_argument("--parallel-sims", type=int, default=16)
    parser.add_argument("--gpu-variant", default="gpu_warp_aggregated", choices=list(common.GPU_VARIANTS))
    parser.add_argument("--budget-ms", type=float, default=16.0, help="frame budget per request (ms); 0 = no frame-budget rows")
    parser.add_argument("--deadline-parallel-sims", type=int, default=256, help="GPU simulations in flight in frame-budget rows")
    args = parser.parse_args(argv)
    q = args.quick
    limit = args.limit or (12 if q else None)
    budgets = args.simulations or ([50] if q else [1000, 10000])
    variants = [v for v in common.chosen_variants(args.backend, q) if v in (common.CPU_VARIANT, args.gpu_variant)]
    rows = []
    for set_name in [s for s in args.sets.split(",") if s]:
        recs, roots = scored_positions(set_name, limit)
        for variant in variants:
            for sims in budgets:
                row = common.attempt(
                    f"{set_name} {variant} {sims} sims", equal_simulations, variant, set_name, recs, roots, sims, args.parallel_sims
                )
                if row is not None:
                    common.progress(row)
                    rows.append(row)
            if args.budget_ms > 0:
                k = args.parallel_sims if variant == common.CPU_VARIANT else args.deadline_parallel_sims
                row = common.attempt(
                    f"{set_name} {variant} {args.budget_ms} ms", frame_budget, variant, set_name, recs, roots, args.budget_ms, k
                )
                if row is not None:
                    common.progress(row)
                    rows.append(row)
    common.finish(BENCHMARK, rows, args.out, ["position_set", "backend", "budget_ms", "simulations", "positions", "optimal_move_rate"])
    return rows


if __name__ == "__main__":
    main()

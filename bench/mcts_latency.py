"""mcts_latency: how long one search of one tree takes, per backend variant.

Measures the wall-clock time of one ``backend.search`` call (tree set-up and
the result included) of ONE tree rooted at the EMPTY board (or ``--moves``),
1000 simulations, random rollouts (UCT), for each variant and number of
simulations in flight per tree (``parallel_sims``, virtual loss):

* ``cpu_reference``: the NumPy reference on one CPU thread, parallel_sims 1
  and 16 (separate rows);
* ``gpu_global_atomic``, ``gpu_warp_aggregated``: ``search_service.cuda``'s
  CudaBackend with each backup (rows skipped, with a note, where it cannot run).

One warm-up call (CUDA kernel compilation, caches), then ``--repeats`` timed
calls, each with another Philox seed; the device is synchronised after each.
Units: ms; rows report the median (p50) and 99th percentile (p99).

Row fields: variant, trees, parallel_sims, simulations, evaluator,
latency_ms_p50, latency_ms_p99, plus position (move string, "" = empty
board) and repeats.

Command (full): ``python3 -m bench.mcts_latency``
Smoke test:     ``python3 -m bench.mcts_latency --quick``
"""
from __future__ import annotations

import dataclasses

from bench import common
from stack.stats import percentiles

BENCHMARK = "mcts_latency"


def measure(variant: str, parallel_sims: int, simulations: int, moves: str, repeats: int) -> dict | None:
    """One row: latency of searching one tree at ``moves`` (None if skipped)."""
    params = common.search_params(simulations=simulations, parallel_sims=parallel_sims, evaluator="rollout")
    if params is None:
        return None
    backend = common.make_backend(variant)
    root = common.positions([moves])

    def call(i: int) -> None:
        backend.search(root, dataclasses.replace(params, seed=1000 + i))

    ms = common.time_calls(call, repeats=repeats, warmup=1)
    p50, p99 = percentiles(ms, 50, 99)
    return dict(
        variant=variant,
        trees=1,
        parallel_sims=parallel_sims,
        simulations=simulations,
        evaluator="rollout",
        position=moves,
        latency_ms_p50=p50,
        latency_ms_p99=p99,
        repeats=repeats,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = common.make_parser(__doc__)
    parser.add_argument("--simulations", type=int, default=None, help="per search (default 1000; quick 50)")
    parser.add_argument("--moves", default="", help='root position as 1-based columns ("" = empty board)')
    parser.add_argument("--cpu-parallel-sims", type=common.int_list, default=[1, 16])
    parser.add_argument("--gpu-parallel-sims", type=common.int_list, default=[1, 16, 64, 256])
    parser.add_argument("--cpu-repeats", type=int, default=None, help="timed calls per CPU row (default 30; quick 3)")
    parser.add_argument("--gpu-repeats", type=int, default=None, help="timed calls per GPU row (default 200; quick 3)")
    args = parser.parse_args(argv)
    sims = args.simulations or (50 if args.quick else 1000)
    rows = []
    for variant in common.chosen_variants(args.backend, args.quick):
        cpu = variant == common.CPU_VARIANT
        repeats = (args.cpu_repeats if cpu else args.gpu_repeats) or (3 if args.quick else 30 if cpu else 200)
        for k in args.cpu_parallel_sims if cpu else args.gpu_parallel_sims:
            row = common.attempt(f"{variant} parallel_sims={k}", measure, variant, k, sims, args.moves, repeats)
            if row is not None:
                common.progress(row)
                rows.append(row)
    common.finish(BENCHMARK, rows, args.out, ["variant", "parallel_sims", "simulations", "latency_ms_p50", "latency_ms_p99"])
    return rows


if __name__ == "__main__":
    main()

"""chaos: the chaos run of loadtest/chaos.py as a benchmark: its result file
carries the GPU, versions, date and command of every benchmark's.

Rows: one per fault (``server``, ``signal``, ``at_s``, ``serving_again_after_s``,
``requests``: per kind sent / answered / refused by code / lost over the
requests scheduled until its server answered again). Summary: ``lost``,
``missed_frame_share``, ``frame_latency_ms``, ``totals``, ``serving_at_the_end``,
``memory_bytes`` (each server's first, last and largest VmRSS), ``trainer``.

Command (GPU): ``bash bench/run_chaos_gpu.sh`` (``python3 -m bench.chaos --minutes 8 --engines 64``)
Smoke test:    ``python3 -m bench.chaos --quick`` (CPU: 1 minute, 2 engines at 10 FPS, a kill every 15 s)
"""
from __future__ import annotations

from pathlib import Path

from bench import common
from loadtest import chaos

BENCHMARK = "chaos"


def main() -> None:
    parser = common.make_parser(__doc__)
    chaos.add_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.engines, args.fps, args.simulations = 1.0, 2, 10.0, 16
        args.kill_every_s, args.stop_s, args.trainer_batch, args.timeout_s = 15.0, 2.0, 4, 5.0
    result = chaos.run(args)
    rows = result.pop("faults")
    common.write_results(BENCHMARK, rows, Path(args.out) if args.out else None, summary=result)
    chaos.print_table({**result, "faults": rows})


if __name__ == "__main__":
    main()

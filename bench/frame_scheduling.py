"""Frame latency at a target FPS under each scheduling policy, with a saturating background client.

Runs the load test (loadtest/frame_scheduling.py) once per scenario --
``uncontended``, ``background_alone``, ``default``, ``dynamic``, ``static`` --
and per way the trainer sends its frames (``grpc``: bytes in each message;
``shm``: shared-memory regions), restarting the three servers each time
(``uncontended`` has no trainer: it runs once). Writes
``bench/results/frame_scheduling.json`` (rows: :data:`ROW_FIELDS` of
loadtest/frame_scheduling.py -- the seed's columns, the critical
``Evaluate``'s server queue and model p99, the bulk lever's mean share --
plus the raw reports), ``frame_scheduling.png`` (latency CDF per policy, one
panel per transport) and every measured frame latency in
``frame_scheduling_latencies.json`` (``{"fps", "title", "latencies_ms":
{transport: {policy: [ms, ...]}}}``) so the PNG can be drawn again where
matplotlib is installed (the GPU machine lacks it).

    python -m bench.frame_scheduling                 # GPU run, both transports (bench/run_scheduling_gpu.sh)
    python -m bench.frame_scheduling --quick         # seconds, on the CPU
    python -m bench.frame_scheduling --background-transport shm   # one transport
    python -m bench.frame_scheduling --plot-only bench/results   # PNG from the latencies file
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from bench import common
from loadtest.background import TRANSPORTS
from loadtest.frame_scheduling import ROW_FIELDS, SCENARIOS, FrameTest, run_scenario

QUICK = FrameTest(engines=1, fps=10.0, simulations=16, warmup_s=0.5, seconds=1.5, background_batch=2,
                  background_workers=1, timeout_s=5.0)


def main(argv: list[str] | None = None) -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--config", type=Path, default=None,
                        help="base config (addresses, models, pools); default deploy/config/tandem.yaml")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of: " + ", ".join(SCENARIOS))
    parser.add_argument("--engines", type=int, default=None)
    parser.add_argument("--fps", type=float, default=None)
    parser.add_argument("--simulations", type=int, default=None, help="search budget per frame")
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per scenario")
    parser.add_argument("--background-batch", type=int, default=None)
    parser.add_argument("--background-transport", default=",".join(TRANSPORTS),
                        help="comma list: how the background trainer sends its frames: grpc (bytes in each message) "
                             "and/or shm (shared-memory regions registered with the reward service); default both")
    parser.add_argument("--logs", type=Path, default=None, help="keep each scenario's server logs here")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--free-ports", action="store_true",
                        help="servers on free loopback ports, metrics off (default with --quick)")
    parser.add_argument("--plot-only", type=Path, metavar="DIR",
                        help="only draw DIR/frame_scheduling.png from DIR/frame_scheduling_latencies.json")
    args = parser.parse_args(argv)
    if args.plot_only:
        doc = json.loads((args.plot_only / LATENCIES_FILE).read_text())
        plot(doc, args.plot_only)
        return
    test = QUICK if args.quick else FrameTest()
    overrides = {"engines": args.engines, "fps": args.fps, "simulations": args.simulations,
                 "seconds": args.seconds, "background_batch": args.background_batch}
    test = dataclasses.replace(test, **{k: v for k, v in overrides.items() if v is not None})
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    transports = [t.strip() for t in args.background_transport.split(",") if t.strip()]
    if not transports or any(t not in TRANSPORTS for t in transports):
        parser.error(f"--background-transport: a comma list of {', '.join(TRANSPORTS)}, got {args.background_transport!r}")
    rows, latencies = [], {t: {} for t in transports}
    for transport in transports:
        for scenario in scenarios:
            if scenario == "uncontended" and transport != transports[0]:
                latencies[transport][scenario] = latencies[transports[0]].get(scenario, [])
                continue  # no trainer: the same run serves every panel
            label = scenario if scenario == "uncontended" else f"{scenario} ({transport})"
            logs = args.logs / transport if args.logs else None
            got = common.attempt(label, run_scenario, scenario, dataclasses.replace(test, background_transport=transport),
                                 args.config, logs, args.free_ports or args.quick)
            if got is None:
                continue
            row, lat = got
            common.progress({k: row[k] for k in ROW_FIELDS})
            rows.append(row)
            latencies[transport][scenario] = lat
    out_dir = Path(args.out if args.out is not None else common.RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"fps": test.fps, "title": f"{test.engines} engines at {test.fps:g} FPS, {test.simulations} simulations/frame",
           "latencies_ms": {t: {k: [round(x, 4) for x in v] for k, v in per.items()} for t, per in latencies.items()}}
    (out_dir / LATENCIES_FILE).write_text(json.dumps(doc) + "\n")
    if not args.no_plot:
        plot(doc, out_dir)
    common.finish("frame_scheduling", rows, args.out, ROW_FIELDS)


LATENCIES_FILE = "frame_scheduling_latencies.json"


def plot(doc: dict, out_dir: Path) -> None:
    """Draws ``out_dir/frame_scheduling.png`` from a latencies document; a note where matplotlib is missing."""
    from loadtest.plot import plot_latencies

    panels = doc["latencies_ms"]
    if any(isinstance(v, list) for v in panels.values()):  # a file from before the transports: one panel
        panels = {"": panels}
    try:
        png = plot_latencies(panels, doc["fps"], Path(out_dir) / "frame_scheduling.png", doc["title"])
        print(f"wrote {png}", flush=True)
    except ImportError:  # matplotlib is in the loadtest extra
        common.note("matplotlib not installed (pip install -e .[loadtest]): no PNG; "
                    f"draw it later with --plot-only {out_dir}")


if __name__ == "__main__":
    main()

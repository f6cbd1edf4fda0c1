"""Frame latency at a target FPS under each scheduling policy, with a saturating background client.

Runs the load test (loadtest/frame_scheduling.py) once per scenario --
``uncontended``, ``background_alone``, ``default``, ``dynamic``, ``static`` --
per way the trainer sends its frames (``grpc``: bytes in each message;
``shm``: shared-memory regions) and per place it sends them (``--bulk-server``
``on``: the reward service's bulk server, a process of its own; ``off``: the
reward service itself), starting the stack again for each policy
(``uncontended`` has no trainer: it runs once). Writes
``bench/results/frame_scheduling.json`` (rows: :data:`ROW_FIELDS` of
loadtest/frame_scheduling.py -- the seed's columns, the critical
``Evaluate``'s server queue and model p99, the bulk lever's mean share,
``bulk_server`` -- plus the raw reports), ``frame_scheduling.png`` (latency
CDF per policy, one panel per transport and place) and every measured frame
latency in ``frame_scheduling_latencies.json`` (``{"fps", "title",
"latencies_ms": {panel: {policy: [ms, ...]}}}``) so the PNG can be drawn
again where matplotlib is installed (the GPU machine lacks it).

    python -m bench.frame_scheduling                 # GPU run, both transports (bench/run_scheduling_gpu.sh)
    python -m bench.frame_scheduling --quick         # seconds, on the CPU
    python -m bench.frame_scheduling --background-transport shm   # one transport
    python -m bench.frame_scheduling --bulk-server on              # the trainer at the bulk server only
    python -m bench.frame_scheduling --plot-only bench/results   # PNG from the latencies file
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

from bench import common
from loadtest.background import TRANSPORTS
from loadtest.frame_scheduling import ROW_FIELDS, SCENARIOS, FrameTest, policy_of, run_scenarios

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
    parser.add_argument("--bulk-server", default="on,off",
                        help="comma list: the trainer sends to the reward service's bulk server (on: a process of "
                             "its own, reward.bulk_server) and/or to the reward service itself (off); default both")
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
    bulk = [b.strip() for b in args.bulk_server.split(",") if b.strip()]
    if not bulk or any(b not in BULK_CHOICES for b in bulk):
        parser.error(f"--bulk-server: a comma list of on, off, got {args.bulk_server!r}")
    rows, latencies, uncontended = [], {}, None
    for transport in transports:
        for on in (BULK_CHOICES[b] for b in bulk):
            panel = latencies.setdefault(f"{transport}, {'bulk server' if on else 'one reward process'}", {})
            todo = [s for s in scenarios if s != "uncontended" or uncontended is None]
            if "uncontended" in scenarios and uncontended is not None:
                panel["uncontended"] = uncontended  # no trainer: the first run serves every panel
            logs = args.logs / f"{transport}-{'bulk' if on else 'one'}" if args.logs else None
            # An attempt per start of the stack (a policy's consecutive scenarios): one that fails costs its own rows.
            for _, group in itertools.groupby(todo, key=policy_of):
                group = list(group)
                label = f"{','.join(group)} ({transport}, bulk server {'on' if on else 'off'})"
                got = common.attempt(label, run_scenarios, group, dataclasses.replace(test, background_transport=transport),
                                     args.config, logs, args.free_ports or args.quick, on) or []
                for scenario, (row, lat) in zip(group, got):
                    common.progress({k: row[k] for k in ROW_FIELDS})
                    rows.append(row)
                    panel[scenario] = lat
                    if scenario == "uncontended":
                        uncontended = lat
    out_dir = Path(args.out if args.out is not None else common.RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"fps": test.fps, "title": f"{test.engines} engines at {test.fps:g} FPS, {test.simulations} simulations/frame",
           "latencies_ms": {t: {k: [round(x, 4) for x in v] for k, v in per.items()} for t, per in latencies.items()}}
    (out_dir / LATENCIES_FILE).write_text(json.dumps(doc) + "\n")
    if not args.no_plot:
        plot(doc, out_dir)
    common.finish("frame_scheduling", rows, args.out, ROW_FIELDS)


LATENCIES_FILE = "frame_scheduling_latencies.json"
BULK_CHOICES = {"on": True, "off": False}  # --bulk-server: reward.bulk_server.enabled


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

"""The engines curve: N independent game engines (`tandem play` processes) at
60 FPS against one `tandem up`, as a game server runs them.

For each policy (``scheduler.policy``) it starts `tandem up` with the shipped
config (the policy changed, nothing else), and for each row starts N `tandem
play` processes at once, each ``--agents`` positions a frame (one
``SearchBatch`` where more than one), each ``--frames`` frames, with an
evaluator, optionally beside a trainer that sends 64-frame batches to the
bulk server by shared memory for the row's whole length
(loadtest/background.py). The engines of a row begin their first frame
together, once all have started (``tandem play --start-at``: 3 s + 0.1 s an
engine after their start). A row pools its engines' reports:

* ``missed_frame_share``: missed frames (late or failed) over all frames;
* ``frame_ms_p50``: the median of the engines' p50s; ``frame_ms_p99``: the
  worst engine's p99;
* ``simulations_per_frame``: the mean over engines of each one's mean per
  agent; ``optimal_move_rate``: over all agents' positions not lost;
* ``trainer_frames_per_s``: the trainer's rate during the row (0: none);
* ``model_simulations_per_frame``, ``value_model_failures`` and
  ``value_model_failure_reasons``: of the simulations, those the value model
  valued, and the searches whose model calls failed (with the three commonest
  reasons);
* which side is late: ``search_request_ms_p50``/``_p99`` and
  ``evaluate_request_ms_p50``/``_p99`` (the engines' answered requests:
  median p50, worst p99; each call's gRPC deadline is its frame's end, as
  an engine sets it, so these stop near the budget: ``--late-answers`` lets
  the engines wait, ``late_answers`` in the row), ``search_server_ms_p50``
  (the searches' own time on the server);
* where the host's time went (bench/row_load.py): ``cpu_cores`` per server
  (its workers summed), ``clients_cpu_cores`` (the engines' CPU, their
  start-up included), ``host_busy_share``, all from the first frame on, and the
  search service's wave loop (all its workers): ``wave_ms_mean``, ``join_ms_mean``,
  ``leave_ms_mean``, ``waves_per_s``, ``trees_per_wave``, the plan's
  ``leaves_per_wave`` and ``wave_expected_ms_mean``, ``left_by`` (searches
  by why they left: budget, proven, deadline, stopped, failed), ``refused_by``
  (refused at admission: full, deadline, spent) and ``shed_by`` (calls shed by
  overload, by method);
* ``workers``, ``reward_workers``: the row's ``search.workers`` and
  ``reward.workers`` (``--workers``, or each alone: ``--search-workers``,
  ``--reward-workers``); ``host_wait``: both services' (``--host-wait``);
  ``switch_interval_us``: both services' interpreter switch interval
  (``--switch-interval-us``: ``server.switch_interval_us``);
  ``queue_wait_target_ms``: both services' overload shedding target
  (``--queue-wait-target-ms``: ``server.queue_wait_target_ms``, 0: off);
* ``variant``: with ``--variants``, the settings its `tandem up` ran with
  over the flags' (each variant its own `tandem up` and rows, in one run:
  ``--variants 'queue_wait_target_ms=0;workers=4'``), else "".

"Games per GPU" is the largest ``engines * agents_per_engine`` of a value-model
row without a trainer whose missed share is at most 0.5 % and whose agents
get at least 100 simulations a frame. Writes ``bench/results/engines.json``
and ``engines.png`` (missed share and simulations per frame against engines).

Usage (GPU: the default curve, then the contended table):
    python -m bench.engines --engines 1,8,32,64,128 --evaluators value_model,rollout \
        --batch 16x16,1x256 --contended 64 --policies default,dynamic,static
CPU smoke test: ``python -m bench.engines --quick``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collections import Counter

import yaml

from bench.common import RESULTS_DIR, int_list, make_parser, note, print_rows, progress, write_results
from bench.row_load import RowLoad
from tandem.config import SearchConfig, ServerConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "deploy" / "config" / "tandem.yaml"
TANDEM = [sys.executable, "-m", "stack"]
COLUMNS = ("engines", "agents_per_engine", "evaluator", "policy", "trainer", "missed_frame_share", "frame_ms_p50",
           "frame_ms_p99", "simulations_per_frame", "optimal_move_rate", "trainer_frames_per_s")
# server settings a run may change (flags): name -> type
SERVER_KEYS = {"switch_interval_us": float, "queue_wait_target_ms": float}
# search settings a variant may change (tandem.config.SearchConfig; --variants only)
SEARCH_KEYS = {"wave_target_ms": float, "value_model_parallel_sims": int, "parallel_sims": int,
               "rollout_slice_ms": float, "max_trees": int}
# The engines begin their first frame together this long after they are started (tandem play
# --start-at), so no frame is played while other engines still start up (their imports take
# ~0.5 s of CPU each): a game server's agents run long after their start.
START_LEAD_S = 3.0
START_LEAD_PER_ENGINE_S = 0.1
MISSED_TARGET = 0.005  # "games per GPU": at most 0.5 % of frames missed ...
MIN_SIMULATIONS = 100  # ... and at least this many simulations per agent a frame


def _config(policy: str, out: Path, search_workers: int | None = None, reward_workers: int | None = None,
            host_wait: str | None = None, server: dict[str, float | None] | None = None,
            search: dict | None = None) -> Path:
    """The shipped config with the row's changes; ``server``: ServerConfig keys
    (SERVER_KEYS) for both services, None: the shipped value; ``search``:
    SearchConfig keys (SEARCH_KEYS) over the search section's."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    cfg.setdefault("scheduler", {})["policy"] = policy
    for service, workers in (("search", search_workers), ("reward", reward_workers)):  # tandem/workers.py
        if workers:
            cfg.setdefault(service, {})["workers"] = workers
        if host_wait:  # tandem.gpu.set_host_wait
            cfg.setdefault(service, {})["host_wait"] = host_wait
        for key, value in (server or {}).items():  # tandem.server.build_server
            if value is not None:
                cfg.setdefault(service, {}).setdefault("server", {})[key] = value
    cfg.setdefault("search", {}).update(search or {})
    path = out / f"tandem_{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Stack:
    """`tandem up` with ``config``, until :meth:`stop`."""

    def __init__(self, config: Path, logs: Path):
        self.config = config
        self.proc = subprocess.Popen([*TANDEM, "up", "--config", str(config), "--log-dir", str(logs)],
                                     stdout=open(logs / "up.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 300
        while subprocess.run([*TANDEM, "status", "--config", str(config)], cwd=ROOT,
                             capture_output=True).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem up did not become SERVING (see {logs / 'up.log'})")
            time.sleep(1)

    def stop(self) -> None:
        self.proc.send_signal(2)  # SIGINT: drains and stops them all
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _trainer(config: Path, seconds: float, report: Path) -> subprocess.Popen:
    code = ("import json, sys, time\n"
            "from loadtest.background import BackgroundProcess\n"
            "from tandem.config import bulk_address, load_config\n"
            "if __name__ == '__main__':\n"
            "    cfg = load_config(sys.argv[1])\n"
            "    bg = BackgroundProcess(bulk_address(cfg), cfg, batch=64, workers=2, transport='shm')\n"
            "    bg.start(); t = time.monotonic(); time.sleep(float(sys.argv[2]))\n"
            "    frames = bg.report()['frames']; rate = frames / (time.monotonic() - t); bg.stop(); bg.close()\n"
            "    json.dump({'frames_per_s': rate}, open(sys.argv[3], 'w'))\n")
    script = report.with_suffix(".py")
    script.write_text(code)
    return subprocess.Popen([sys.executable, str(script), str(config), str(seconds), str(report)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _request_ms(done: list[dict], kind: str) -> tuple[float | None, float | None]:
    """(median of the engines' p50s, worst p99) of their ``kind`` requests (ms)."""
    got = [r["request_latency_ms"][kind] for r in done if kind in r.get("request_latency_ms", {})]
    p50s = sorted(g["p50"] for g in got if g["p50"] is not None)
    p99s = [g["p99"] for g in got if g["p99"] is not None]
    return (p50s[len(p50s) // 2] if p50s else None), (max(p99s) if p99s else None)


def run_row(config: Path, work: Path, engines: int, agents: int, evaluator: str, frames: int, fps: float,
            trainer: str, stack_pid: int | None = None, late_answers: bool = False) -> dict:
    """One row: ``engines`` play processes at once (and the trainer); their pooled
    figures, and where the host's time went (bench/row_load.py; ``stack_pid``:
    the ``tandem up`` process, None: not measured). ``late_answers``: the
    engines wait for late answers (``tandem play --late-answers``)."""
    tag = f"{engines}x{agents}_{evaluator}_{trainer}_{config.stem}"
    reports = [work / f"{tag}_{e}.json" for e in range(engines)]
    train_report = work / f"{tag}_trainer.json"
    lead_s = START_LEAD_S + START_LEAD_PER_ENGINE_S * engines  # the engines' first frame after their start
    # The trainer outlasts the engines' last frame: its 5 s head start, their lead and frames, and a margin.
    train = _trainer(config, lead_s + frames / fps + 10, train_report) if trainer != "none" else None
    if train is not None:
        time.sleep(5)  # the trainer at full rate before the engines start
    start_at = time.time() + lead_s
    plays = [subprocess.Popen([*TANDEM, "play", "--config", str(config), "--frames", str(frames), "--fps", str(fps),
                               "--agents", str(agents), "--evaluator", evaluator, "--seed", str(e + 1),
                               "--start-at", f"{start_at:.3f}",
                               "--report", str(r), *(["--late-answers"] if late_answers else [])], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for e, r in enumerate(reports)]
    load = None
    if stack_pid is not None:  # from the first frame: the servers' figures cover the frames, not the start-up
        time.sleep(max(start_at - time.time(), 0.0))
        load = RowLoad(stack_pid, yaml.safe_load(config.read_text()).get("search", {}).get(
            "metrics_port", SearchConfig.metrics_port))
    for p in plays:
        p.wait()
    host = load.finish() if load is not None else {}
    trainer_rate = 0.0
    if train is not None:
        train.wait()
        trainer_rate = json.loads(train_report.read_text())["frames_per_s"] if train_report.exists() else None
    done = [json.loads(r.read_text()) for r in reports if r.exists()]
    if len(done) < engines:
        note(f"{tag}: {engines - len(done)} engine(s) wrote no report")
    total = frames * engines  # engines that wrote nothing missed all their frames
    missed = sum(r["missed_frames"] for r in done) + frames * (engines - len(done))
    p50s = sorted(r["frame_latency_ms"]["p50"] for r in done if r["frame_latency_ms"]["p50"] is not None)
    p99s = [r["frame_latency_ms"]["p99"] for r in done if r["frame_latency_ms"]["p99"] is not None]
    not_lost = sum(r["positions_not_lost"] for r in done)
    kept = sum((r["optimal_move_rate"] or 0) * r["positions_not_lost"] for r in done)
    search_kind = "search" if agents == 1 else "search_batch"
    (search_p50, search_p99), (evaluate_p50, evaluate_p99) = _request_ms(done, search_kind), _request_ms(done, "evaluate")
    server_p50s = sorted(r["search_latency_ms"]["p50"] for r in done if r["search_latency_ms"]["p50"] is not None)
    return {
        "engines": engines,
        "agents_per_engine": agents,
        "evaluator": evaluator,
        "policy": config.stem.removeprefix("tandem_"),
        "trainer": trainer,
        "missed_frame_share": round(missed / total, 4),
        "frame_ms_p50": p50s[len(p50s) // 2] if p50s else None,
        "frame_ms_p99": max(p99s) if p99s else None,
        "simulations_per_frame": _mean([r["simulations_per_frame"]["mean"] for r in done]) or 0.0,
        "optimal_move_rate": round(kept / not_lost, 4) if not_lost else None,
        "trainer_frames_per_s": trainer_rate,
        "frames_per_engine": frames,
        "errors": dict(sum((Counter(r["errors"]) for r in done), Counter())),
        # The three commonest failures, with their messages' first characters.
        "error_reasons": dict(sum((Counter(r.get("error_reasons", {})) for r in done), Counter()).most_common(3)),
        "backends": sorted({b for r in done for b in r["backends"]["search"]}),
        # Of the simulations, those the value model valued; the searches whose model calls failed, and the
        # three commonest failures (the rest of such a search went on with rollouts).
        "model_simulations_per_frame": _mean([r["model_simulations_per_frame"] for r in done]),
        "value_model_failures": sum(r["value_model_failures"] for r in done),
        "value_model_failure_reasons": dict(sum((Counter(r["value_model_failure_reasons"]) for r in done),
                                                Counter()).most_common(3)),
        # Which side is late: the engines' Search (or SearchBatch) and Evaluate request times, and the
        # searches' own time on the server (its wave loop; the rest of a request is gRPC and queues).
        "search_request_ms_p50": search_p50, "search_request_ms_p99": search_p99,
        "evaluate_request_ms_p50": evaluate_p50, "evaluate_request_ms_p99": evaluate_p99,
        "search_server_ms_p50": server_p50s[len(server_p50s) // 2] if server_p50s else None,
        **host,
    }


def _mean(values: list) -> float | None:
    """The mean of the values that are not None, to 0.1; None if none is."""
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 1) if values else None


def games_per_gpu(rows: list[dict]) -> int:
    """The most agents (engines x agents each) of a value-model row without a
    trainer that keeps the targets (module docstring), of the run's first
    variant (the flags' settings where --variants starts with one); 0 if none does."""
    first = rows[0].get("variant", "") if rows else ""
    ok = [r["engines"] * r["agents_per_engine"] for r in rows if r.get("variant", "") == first
          and r["evaluator"] == "value_model" and r["trainer"] == "none" and r["missed_frame_share"] <= MISSED_TARGET
          and r["simulations_per_frame"] >= MIN_SIMULATIONS]
    return max(ok, default=0)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ev, variant in sorted({(r["evaluator"], r.get("variant", "")) for r in rows}):
        curve = sorted(((r["engines"] * r["agents_per_engine"], r) for r in rows
                        if r["evaluator"] == ev and r.get("variant", "") == variant and r["trainer"] == "none"
                        and r["policy"] == rows[0]["policy"]),
                       key=lambda nr: nr[0])  # ties (16x16 and 1x256): kept in run order
        xs = [n for n, _ in curve]
        label = f"{ev} ({variant})" if variant else ev
        ax1.plot(xs, [100 * r["missed_frame_share"] for _, r in curve], "o-", label=label)
        ax2.plot(xs, [r["simulations_per_frame"] for _, r in curve], "o-", label=label)
    for ax, label in ((ax1, "missed frames (%)"), (ax2, "simulations per agent a frame")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents (engines x agents each)")
        ax.set_ylabel(label)
        ax.legend()
    ax1.axhline(100 * MISSED_TARGET, color="grey", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# What --variants may change, each as its flag does (over the flags' values).
VARIANT_KEYS = {"workers": int, "search_workers": int, "reward_workers": int, "host_wait": str,
                **SERVER_KEYS, **SEARCH_KEYS}


def parse_variants(text: str) -> list[dict]:
    """``--variants``: ``;``-separated variants, each ``key=value`` pairs
    separated by ``,`` over VARIANT_KEYS (e.g. ``workers=4,queue_wait_target_ms=0``);
    "" is one variant with no change.

    Raises:
        SystemExit: a key that is not one of VARIANT_KEYS, or a value of the wrong type.
    """
    variants = []
    for part in (text.split(";") if text else [""]):
        variant = {}
        for pair in filter(None, part.split(",")):
            key, _, value = pair.partition("=")
            key = key.strip().replace("-", "_")
            if key not in VARIANT_KEYS:
                raise SystemExit(f"--variants: {key!r} is not one of {', '.join(VARIANT_KEYS)}")
            try:
                variant[key] = VARIANT_KEYS[key](value)
            except ValueError:
                raise SystemExit(f"--variants: {key}={value!r} is not a {VARIANT_KEYS[key].__name__}") from None
        variants.append(variant)
    return variants


def variant_label(variant: dict) -> str:
    """A variant as its rows name it ("" for the flags' own settings)."""
    return ",".join(f"{key}={value}" for key, value in variant.items())


def variant_settings(flags: dict, variant: dict) -> dict:
    """The settings (VARIANT_KEYS) a variant's `tandem up` runs with: the
    flags' (``flags``: the parsed arguments), the variant's over them; a
    variant's ``workers`` goes over the flags' per-service workers too."""
    settings = {key: flags.get(key) for key in VARIANT_KEYS}  # SEARCH_KEYS: None (no flags)
    if "workers" in variant:
        settings["search_workers"] = settings["reward_workers"] = None
    settings.update(variant)
    return settings


def _run_plan(config: Path, work: Path, policy: str, plan: list[tuple], args, variant: str) -> list[dict]:
    """The rows of ``plan`` (engines, agents, evaluator, trainer) against one
    `tandem up` with ``config``, each with the settings it ran with."""
    logs = work / f"logs_{policy}"
    logs.mkdir()
    stack = Stack(config, logs)
    rows = []
    try:
        for engines, agents, ev, trainer in plan:
            row = run_row(config, work, engines, agents, ev, args.frames, args.fps, trainer, stack.proc.pid,
                          args.late_answers)
            row["late_answers"] = args.late_answers
            written = yaml.safe_load(config.read_text())
            row["workers"] = written.get("search", {}).get("workers", 1)
            row["reward_workers"] = written.get("reward", {}).get("workers", 1)
            row["host_wait"] = written.get("search", {}).get("host_wait", "auto")
            for key in SERVER_KEYS:
                row[key] = written.get("search", {}).get("server", {}).get(key, getattr(ServerConfig, key))
            row["variant"] = variant
            progress(row)
            rows.append(row)
    finally:
        stack.stop()
    return rows


def main() -> None:
    ap = make_parser(__doc__)
    ap.add_argument("--engines", type=int_list, default=[1, 8, 32, 64, 128])
    ap.add_argument("--evaluators", default="value_model,rollout")
    ap.add_argument("--batch", default="16x16,1x256", help="rows of engines x agents each, sending batch calls")
    ap.add_argument("--contended", type=int, default=64, help="engines beside the trainer (0: no such rows)")
    ap.add_argument("--policies", default="default,dynamic,static", help="policies of the contended rows")
    ap.add_argument("--frames", type=int, default=600)
    ap.add_argument("--fps", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=None,
                    help="search.workers and reward.workers (default: the shipped config's)")
    ap.add_argument("--search-workers", type=int, default=None, help="search.workers alone (over --workers)")
    ap.add_argument("--reward-workers", type=int, default=None, help="reward.workers alone (over --workers)")
    ap.add_argument("--host-wait", default=None, choices=("auto", "spin", "yield", "block"),
                    help="search.host_wait and reward.host_wait (default: the shipped config's)")
    ap.add_argument("--late-answers", action="store_true",
                    help="the engines wait up to ten frames for each answer (tandem play --late-answers), so the "
                         "request times show how late answers come; default: each call's deadline is its frame's end")
    ap.add_argument("--switch-interval-us", type=float, default=None,
                    help="search and reward server.switch_interval_us (default: the shipped config's)")
    ap.add_argument("--queue-wait-target-ms", type=float, default=None,
                    help="search and reward server.queue_wait_target_ms, 0: no shedding (default: the shipped config's)")
    ap.add_argument("--variants", default="",
                    help="';'-separated variants, each its own `tandem up` and rows, e.g. "
                         "'queue_wait_target_ms=0;workers=4' (keys: the flags above, with _, and the search "
                         f"settings {', '.join(SEARCH_KEYS)})")
    args = ap.parse_args()
    if args.quick:
        args.engines, args.evaluators, args.batch, args.contended, args.frames = [1, 2], "rollout", "1x4", 2, 60
        args.policies = "default"
    evaluators = [e for e in args.evaluators.split(",") if e]
    batches = [tuple(int(x) for x in b.split("x")) for b in args.batch.split(",") if b]
    policies = [p for p in args.policies.split(",") if p]
    out = Path(args.out) if args.out else RESULTS_DIR
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="engines_") as tmp:
        for v, variant in enumerate(parse_variants(args.variants)):
            settings = variant_settings(vars(args), variant)
            work = Path(tmp) / f"variant_{v}"
            work.mkdir()
            for i, policy in enumerate(policies):
                config = _config(policy, work, settings["search_workers"] or settings["workers"],
                                 settings["reward_workers"] or settings["workers"], settings["host_wait"],
                                 {key: settings[key] for key in SERVER_KEYS},
                                 {key: settings[key] for key in SEARCH_KEYS if settings.get(key) is not None})
                plan = [] if i else [(n, 1, ev, "none") for ev in evaluators for n in args.engines]
                plan += [] if i else [(n, k, evaluators[0], "none") for n, k in batches]
                plan += [(args.contended, 1, evaluators[0], "shm")] if args.contended else []
                rows += _run_plan(config, work, policy, plan, args, variant_label(variant))
    write_results("engines", rows, out, summary={"games_per_gpu": games_per_gpu(rows)})
    plot(rows, out / "engines.png")
    print_rows(rows, COLUMNS)
    print(f"games per GPU (value model, <= {100 * MISSED_TARGET:g} % missed, >= {MIN_SIMULATIONS} simulations): "
          f"{games_per_gpu(rows)}")


if __name__ == "__main__":
    main()

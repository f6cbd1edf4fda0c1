"""neural_search: the value model inside the search, across the two services.

Starts the reward service in a child process (the shipped config's models, a
free loopback port) and searches with the CUDA backend (``--backend``'s GPU
variant; the CPU reference where no GPU runs it) whose leaves go to the reward
service by each hand-off (``handoff``), all in one run: ``leaf_channel``, the leaf
channel (tandem/leaf_channel.py: one Unix-socket message each way per wave)
with CUDA IPC regions as device waves (the selection kernel writes the leaves
into the input region, the backup kernel reads the outputs from the output
region: what a GPU search service does; CUDA events and the ready word order
the two services' work, tandem/cuda_events.py, tandem/ready_word.py);
``leaf_channel_synchronised``, device waves over a channel without events
(each side synchronises its stream before its message);
``leaf_channel_host``, the same channel with the leaves and answers on the
host (system regions, or a GPU search without device waves); ``grpc``, one
``Evaluate`` per wave; and ``in_process`` / ``in_process_host``, co-located
mode's hand-off (tandem/in_process.py): a second reward service started in
this process, its critical lane reached with no socket: ``in_process``,
device waves (the search's stream waits for the model on the GPU), and
``in_process_host``, host waves. ``CudaBackend.search`` is a batch of trees
like the service's (search_service/cuda/backend.py), one wave at a time.

Three kinds of row (``kind``):

* ``latency``: 1000 simulations of one tree from the empty board, value model,
  waves of ``wave`` leaves (32, 64, 128, 256); p50/p99 of ``--repeats`` calls,
  each timed to its return (its answer on the host: a search synchronises its
  own stream for its results), then the device synchronised untimed before
  the next (``sync_ms_p50``: how long that took; in-process ~0.2-0.3 ms with
  nothing of the search left to run, 76bf816's GPU timeline);
  per call the time split into kernels (select + backup), hand-off (the
  evaluate step's wall time less the reward service's own queue + model
  time) and model (that service time), per wave in µs; the hand-off split
  again into ``transport`` (the evaluator's call less the service time:
  copies, socket or gRPC, the service's own work around its batcher,
  decoding) and ``bookkeeping`` (the backend's host work on the wave around
  the call), and the model into ``queue`` and ``compute``; ``evals_per_s``
  the leaves valued per second of search.
* ``throughput``: the value model's evaluated positions per second through
  one hand-off of ``batch`` boards (64 .. 8192; a batch larger than the
  hand-off carries is left out), as a client sees it.
* ``timeline`` (``--timeline``): where the time of the ``leaf_channel`` latency rows
  goes, from the marks both services record (tandem/timeline.py): per pair
  of consecutive marks (``from_mark`` -> ``to_mark``, in either process),
  the median and p90 of the µs between them over every wave of the row's
  searches (``us_p50``, ``us_p90``, ``count``; pairs seen fewer times than
  the row has searches are left out), and ``search.start`` -> ``search.end``
  (``step``: ``total``; else ``consecutive``).
* ``gpu_timeline`` (``--timeline --gpu-marks``): the same from the GPU marks
  (tandem/timeline.py: when each stream reached a point, on the GPU's
  clock). The stamps' kernels lengthen those rows' searches: their
  latencies are not the clean ones.
* ``search_quality``: ``optimal_move_rate`` with a 16 ms deadline per
  position (each its own search, as served: the evaluation cache of the
  serving path in front of the reward service, the leaf channel where it
  attaches), value model against rollouts in the same run, on every bundled
  Pons set (``--positions`` per set); the value model at each ``--value-waves``
  wave size (default: the config's ``search.value_model_parallel_sims``), and
  at each ``--value-sims-per-warp`` (simulations of a wave per warp: 1, the
  service's, selects a wave's leaves all at once, one warp each; 32, a warp
  selects 32 in order, each seeing the virtual loss of those before it, as
  the CPU reference does; row field ``sims_per_warp``). The latency rows
  too run at each ``--value-sims-per-warp``.

With ``--mps`` both processes are clients of one CUDA MPS server, as ``tandem
up`` runs them where MPS can run (scheduler/mps.py): the two processes' kernels
then share the GPU instead of time-slicing between their contexts (row field
``mps``).

Row fields: mps, kind, handoff, simulations, wave, latency_ms_p50, latency_ms_p99,
kernel_ms, handoff_us_per_wave, model_us_per_wave, queue_us_per_wave,
compute_us_per_wave, transport_us_per_wave, bookkeeping_us_per_wave, waves, sync_ms_p50, evals_per_s; batch;
position_set, evaluator, budget_ms, positions, optimal_move_rate, missed
(the missed positions' move strings), played (the column each missed one
played), simulations_mean; step, from_mark,
to_mark, us_p50, us_p90, count.

Command (full): ``python3 -m bench.neural_search --mps`` (``--kinds search_quality``: those rows only)
Smoke test:     ``python3 -m bench.neural_search --quick`` (CPU reference, small sizes)
"""
from __future__ import annotations

import collections
import contextlib
import cProfile
import dataclasses
import functools
import glob
import multiprocessing
import os
import pstats
import socket
import tempfile
import time
from dataclasses import replace

import numpy as np

from bench import common
from scheduler import mps
from stack.stats import percentiles
from tandem import timeline
from tandem.config import load_config
from tandem.deadline import Deadline
from tandem.device import mps_client_env, mps_directories

BENCHMARK = "neural_search"
COLUMNS = ("kind", "handoff", "wave", "batch", "position_set", "evaluator", "latency_ms_p50", "kernel_ms", "handoff_us_per_wave",
           "model_us_per_wave", "evals_per_s", "optimal_move_rate", "simulations_mean", "from_mark", "to_mark", "us_p50")
SETS = ("Test_L1_R1", "Test_L1_R2", "Test_L2_R1", "Test_L3_R1")


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _device_waves(evaluator, rows: int):
    """Device waves over ``evaluator``'s leaf channel (no deadline) when it has
    CUDA regions of ``rows`` rows or more, else None (that row is skipped)."""
    from search_service.evaluators import DeviceWaves

    if not DeviceWaves.fits(evaluator.channel):
        return None
    waves = DeviceWaves(evaluator, None)
    return waves if waves.carries(rows) else None


def _row_handoff(evaluator, device) -> str:
    """A row's ``handoff``: ``leaf_channel`` (device waves ordered by CUDA
    events), ``leaf_channel_synchronised`` (device waves, a channel without
    events), ``leaf_channel_host`` (the leaf channel through the host),
    ``in_process`` / ``in_process_host`` (a reward service in this process:
    device waves, host waves) or ``grpc``."""
    if evaluator.handoff == "grpc":
        return "grpc"
    if not device:
        return f"{evaluator.handoff}_host"
    if evaluator.handoff == "leaf_channel" and not evaluator.channel.ordered:
        return "leaf_channel_synchronised"
    return evaluator.handoff


def latency(backend, evaluator, wave: int, simulations: int, repeats: int, device: bool = False) -> dict | None:
    """One ``latency`` row: ``repeats`` searches of the empty board; ``device``:
    the leaf channel's CUDA regions as device waves (handoff ``leaf_channel``; the
    same channel the host way is ``leaf_channel_host``)."""
    params = common.search_params(simulations=simulations, parallel_sims=wave, evaluator="value_model")
    if params is None:
        return None
    root = common.positions([""])
    kw = {}
    if device:
        waves = _device_waves(evaluator, wave)
        if waves is None:
            return None
        kw = {"device_waves": waves}
    handoff = _row_handoff(evaluator, device)
    backend.search(root, params, evaluator, **kw)  # warm-up: kernels, the reward session's buckets
    ms, sync_ms, kernel, waves = [], [], [], []
    per_wave = {k: [] for k in ("handoff", "model", "queue", "compute", "call_rest", "bookkeeping")}  # µs
    for seed in range(repeats):
        before = dataclasses.replace(evaluator.totals)
        t = time.perf_counter()
        (r,), _ = backend.search(root, replace(params, seed=seed + 1), evaluator, **kw)
        ms.append((time.perf_counter() - t) * 1e3)  # the answer is on the host: the search's latency
        t = time.perf_counter()
        common.sync_cuda()  # nothing of this search is left to run; the next one starts on an idle device
        sync_ms.append((time.perf_counter() - t) * 1e3)
        after = evaluator.totals
        n = max(after.calls - before.calls, 1)
        queue, compute = after.queue_ms - before.queue_ms, after.compute_ms - before.compute_ms
        call = after.call_ms - before.call_ms
        kernel.append(r.select_ms + r.expand_ms + r.backup_ms)
        for key, total_ms in (("handoff", r.evaluate_ms - queue - compute), ("model", queue + compute),
                              ("queue", queue), ("compute", compute), ("call_rest", call - queue - compute),
                              ("bookkeeping", r.evaluate_ms - call)):
            per_wave[key].append(total_ms * 1e3 / n)
        waves.append(after.calls - before.calls)
    p50, p99 = percentiles(ms, 50, 99)
    med = {k: float(np.median(v)) for k, v in per_wave.items()}
    return dict(kind="latency", handoff=handoff, simulations=simulations, wave=wave, latency_ms_p50=p50,
                latency_ms_p99=p99, kernel_ms=float(np.median(kernel)), handoff_us_per_wave=med["handoff"],
                model_us_per_wave=med["model"], queue_us_per_wave=med["queue"], compute_us_per_wave=med["compute"],
                transport_us_per_wave=med["call_rest"], bookkeeping_us_per_wave=med["bookkeeping"],
                waves=float(np.median(waves)), sync_ms_p50=float(np.median(sync_ms)),
                evals_per_s=simulations / (p50 / 1e3), repeats=repeats)


def throughput(evaluator, batch: int, repeats: int, device: bool = False) -> dict | None:
    """One ``throughput`` row: ``batch`` boards through ``evaluator``'s hand-off,
    round trips per second x batch; ``device``: boards already in the CUDA
    input region, answers left in the output region (``leaf_channel``; host arrays
    both ways through the same channel: ``leaf_channel_host``)."""
    boards = np.random.default_rng(batch).integers(0, 2, (batch, 2, 6, 7)).astype(np.uint8)
    call = lambda: evaluator(boards)  # noqa: E731 - one call, timed below
    if device:
        waves = _device_waves(evaluator, batch)
        if waves is None:
            return None
        waves.inputs[:batch].set(boards)
        common.sync_cuda()
        call = lambda: waves.evaluate(batch)  # noqa: E731 - one call, timed below
    handoff = _row_handoff(evaluator, device)
    call()
    ms = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        ms.append((time.perf_counter() - t) * 1e3)
    (p50,) = percentiles(ms, 50)
    return dict(kind="throughput", handoff=handoff, batch=batch, latency_ms_p50=p50,
                evals_per_s=batch / (p50 / 1e3), repeats=repeats)


def quality(backend, evaluator, set_name: str, limit: int, name: str, wave: int, budget_ms: float,
            handoff=None) -> dict | None:
    """One ``search_quality`` row: each position of the set its own ``budget_ms``
    search, after one untimed search of the empty board, as each latency row
    begins with one: the row measures searches at steady state, not the
    serving path's first use (the first search of a run spent its 16 ms on
    start-up and answered with no simulation, 2026-12-02)."""
    from bench.search_quality import missed, played, rate, scored_positions
    from search_service.games import connect4

    ev = "value_model" if name == "value_model" else "rollout"
    params = common.search_params(simulations=None, deadline_ms=budget_ms, parallel_sims=wave, evaluator=ev)
    if params is None:
        return None
    recs, roots = scored_positions(set_name, limit)
    model = evaluator if ev == "value_model" else None
    actions, sims, lent = [], [], set()
    lend = getattr(handoff, "lend", None) if model is not None and backend.name.startswith("cuda") else None

    def search(root, seed: int):
        # Bound the model calls by the search's deadline, and lend device waves, as the search server does.
        deadline = Deadline.after_ms(budget_ms)
        leaf = model.until(deadline) if model is not None else None
        with lend(deadline) if lend else contextlib.nullcontext() as waves:
            kw = {"device_waves": waves} if waves is not None else {}
            (r,), _ = backend.search(root, replace(params, seed=seed), leaf, **kw)
            return r, waves.handoff if waves is not None else getattr(handoff, "handoff", None)

    search(connect4.parse_moves(""), 0)
    for i in range(len(recs)):
        r, how = search(connect4.take(roots, i), i + 1)
        if model is not None:  # the lent waves' hand-off, else the host calls' (the last one's)
            lent.add(how)
        actions.append(r.action)
        sims.append(r.simulations)
    how = "+".join(sorted(lent)) if lent else None  # each search's hand-off, joined where they differ
    return dict(kind="search_quality", handoff=how, position_set=set_name,
                evaluator=name, budget_ms=budget_ms, wave=wave, positions=len(recs),
                optimal_move_rate=rate(recs, actions), missed=missed(recs, actions), played=played(recs, actions),
                simulations_mean=float(np.mean(sims)))


def _serve_reward(cfg, ready, stop) -> None:
    """The reward service in a child process: a CUDA IPC handle opens only in
    another process than the one that made it, as with ``tandem up``."""
    from reward_service import server as reward_server

    service = reward_server.start(cfg, follow_scheduler=False)
    ready.set()
    stop.wait()
    service.stop()
    timeline.dump()  # with --timeline: its marks, for the parent to read


def timeline_rows(wave: int, search_marks: list, service_marks: list, searches: int,
                  handoff: str = "leaf_channel") -> list[dict]:
    """The ``timeline`` rows of one latency row: its searches' marks (this
    process; in-process, the reward service's too) with the reward service's
    marks of the same span (its own process's), in time order."""
    if not search_marks:
        return []
    lo, hi = search_marks[0][0], search_marks[-1][0]
    marks = sorted(search_marks + [m for m in service_marks if lo <= m[0] <= hi])
    gaps = collections.defaultdict(list)  # (from, to) -> µs
    for (t0, a), (t1, b) in zip(marks, marks[1:]):
        gaps[(a, b)].append((t1 - t0) / 1e3)
    starts = [t for t, n in search_marks if n == "search.start"]
    ends = [t for t, n in search_marks if n == "search.end"]
    gaps[("search.start", "search.end", "total")] = [(e - s) / 1e3 for s, e in zip(starts, ends)]
    rows = []
    for key, us in sorted(gaps.items(), key=lambda kv: -len(kv[1])):
        if len(us) < searches:
            continue
        p50, p90 = np.percentile(us, [50, 90])
        rows.append(dict(kind="timeline", handoff=handoff, wave=wave, step="total" if len(key) == 3 else "consecutive",
                         from_mark=key[0], to_mark=key[1], us_p50=float(p50), us_p90=float(p90), count=len(us)))
    return rows


def _in_process(cfg, device: bool):
    """An evaluator over a link of the reward service started in this
    process (handoff ``in_process``), as co-located mode's search gets one."""
    from search_service.evaluators import HANDOFF_IN_PROCESS, LeafChannelEvaluator
    from tandem import in_process

    link = in_process.find(cfg.reward.address).link("connect4_value", cfg.reward.leaf_channel.max_rows, device=device)
    return LeafChannelEvaluator(link, timeout_s=30, handoff=HANDOFF_IN_PROCESS)


def _leaf_channel(stub, max_rows: int, events: bool = True):
    """A leaf-channel evaluator attached to the reward service behind ``stub``,
    carrying waves of up to ``max_rows`` rows (``events``: offer CUDA events
    to order its waves by)."""
    from search_service.evaluators import LeafChannelEvaluator
    from tandem.leaf_channel import LeafChannel

    channel = LeafChannel.offered(stub, "connect4_value", max_rows, timeout_s=30, events=events)
    if channel is None:
        raise SystemExit("the reward service offers no leaf channel (reward.leaf_channel.enabled)")
    common.note(f"leaf channel: {channel.kind} input region, ordered by events: {channel.ordered}")
    return LeafChannelEvaluator(channel, timeout_s=30)  # as the gRPC evaluator it is measured against


def _timed_rows(ways, kinds, args, value_backends, rows: list, marked: list, profiler) -> None:
    """The latency and throughput rows of each (evaluator, device) hand-off
    in ``ways`` whose row handoff ``--handoffs`` names, appended to ``rows``
    (and their marks to ``marked``, with ``--timeline``)."""
    ways = [(e, d) for e, d in ways if not args.handoffs or _row_handoff(e, d) in args.handoffs.split(",")]
    for (direct, device), g in ((w, g) for w in ways for g in value_backends) if "latency" in kinds else ():
        for wave in (8,) if args.quick else (32, 64, 128, 256):
            if profiler:
                profiler.enable()
            timeline.take()  # only this row's marks from here
            timeline.take_gpu()
            row = common.attempt(f"latency {direct.handoff} device={device} wave {wave} G {g}", latency,
                                 value_backends[g], direct, wave, 64 if args.quick else 1000,
                                 2 if args.quick else args.repeats, device)
            if profiler:
                profiler.disable()
            if row and args.timeline and row["handoff"] in ("leaf_channel", "in_process"):
                marked.append((wave, g, timeline.take(), row["repeats"], row["handoff"], timeline.take_gpu()))
            if row:
                row["sims_per_warp"] = g
                common.progress(row)
                rows.append(row)
    for direct, device in ways if "throughput" in kinds else ():
        for batch in (64,) if args.quick else (64, 256, 1024, 4096, 8192):
            row = throughput(direct, batch, 3 if args.quick else args.repeats, device)
            if row:
                common.progress(row)
                rows.append(row)


def _mps_clients(cfg):
    """Makes this process, and the reward service's it spawns, clients of the
    MPS control daemon in the config's pipe directory (started if none
    answers: scheduler/mps.py), as ``tandem up`` runs the services; returns
    the control (stopped at the end if started here).

    Raises:
        SystemExit: MPS cannot run here (its message says why).
    """
    pipe, logs = mps_directories(cfg.scheduler)
    control = mps.ensure(pipe, logs, True)
    if not control.active:
        raise SystemExit(f"--mps: {control.message}")
    common.note(f"MPS: {control.message}")
    os.environ.update(mps_client_env(pipe, logs))
    return control


def main() -> None:
    parser = common.make_parser(__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--positions", type=int, default=200, help="positions per set for the quality rows")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the latency rows into neural_search_profile.txt (the 40 costliest "
                             "functions) and neural_search_profile.prof (all of it) beside the result file")
    parser.add_argument("--kinds", default="latency,throughput,search_quality",
                        help="comma list of the row kinds to run (default: all three)")
    parser.add_argument("--timeline", action="store_true",
                        help="record both services' marks (tandem/timeline.py) during the leaf_channel latency rows "
                             "and add the timeline rows")
    parser.add_argument("--value-sims-per-warp", type=common.int_list, default=[1],
                        help="comma list: simulations per warp (CUDA) of the latency rows and the value model's "
                             "quality rows (default 1)")
    parser.add_argument("--gpu-marks", action="store_true",
                        help="with --timeline: GPU marks too (tandem/timeline.py; each a small kernel on its stream, "
                             "so the latency rows of such a run are not the clean ones) and the gpu_timeline rows")
    parser.add_argument("--handoffs", default="",
                        help="comma list: only the latency and throughput rows of these hand-offs (e.g. "
                             "in_process,leaf_channel; default: every one)")
    parser.add_argument("--serving", choices=("leaf_channel", "in_process"), default="leaf_channel",
                        help="the quality rows' hand-off: the leaf channel to the reward service's own process "
                             "(two processes, as tandem up runs them), or in-process (co-located mode)")
    parser.add_argument("--mps", action="store_true",
                        help="run both processes as clients of a CUDA MPS control daemon (attached to, or started "
                             "and stopped here, as the scheduler does under tandem up); every row gets mps: true")
    parser.add_argument("--value-waves", type=common.int_list, default=None,
                        help="comma list: leaves per wave of the value model's quality rows "
                             "(default: the config's search.value_model_parallel_sims)")
    args = parser.parse_args()
    kinds = set(args.kinds.split(","))
    if kinds - {"latency", "throughput", "search_quality"}:
        parser.error(f"--kinds: unknown {sorted(kinds - {'latency', 'throughput', 'search_quality'})}")
    if args.gpu_marks and not args.timeline:
        parser.error("--gpu-marks needs --timeline")
    if args.timeline:  # before the reward service's process starts: it inherits the setting
        timeline.enable(tempfile.mkdtemp(prefix="tandem-timeline-"), gpu=args.gpu_marks)
    cfg = load_config()
    control = _mps_clients(cfg) if args.mps else None  # before this process or the reward service's makes a context
    try:
        _run(args, kinds, cfg, control is not None)
    finally:
        if control is not None:  # this process is a client: the daemon quits once it has exited
            mps.stop(control, wait=False)


def _run(args, kinds: set[str], cfg, on_mps: bool) -> None:
    """The rows of ``kinds`` (main's arguments), written to the result file."""
    from tandem.v1 import reward_pb2_grpc

    from reward_service import server as reward_server
    from search_service.evaluators import HandoffEvaluator, RewardServiceEvaluator
    from search_service.leaf_cache import CachedEvaluator, EvaluationCache
    from tandem import in_process
    from tandem.server import channel

    cfg = replace(cfg, reward=replace(cfg.reward, address=_free_address(), metrics_port=0,
                                      **({"execution_provider": "cpu"} if args.quick else {})))
    variant = (common.chosen_variants(args.backend, args.quick) or [common.CPU_VARIANT])[-1]
    backend = common.make_backend(variant)
    common.note(f"search backend: {variant}")
    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    service = spawn.Process(target=_serve_reward, args=(cfg, ready, stop), daemon=True)
    service.start()
    if not ready.wait(300):
        raise SystemExit("the reward service did not start in 300 s")
    rows, marked = [], []  # marked: (wave, G, this process's marks, searches, handoff, its GPU marks) of the timed latency rows
    profiler = cProfile.Profile() if args.profile else None
    value_backends = {g: backend if g == 1 else common.make_backend(variant, g) for g in args.value_sims_per_warp}
    timed = functools.partial(_timed_rows, kinds=kinds, args=args, value_backends=value_backends, rows=rows,
                              marked=marked, profiler=profiler)
    local = None  # the in-process reward service, started once the two-process rows are done
    try:
        with channel(cfg.reward.address, cfg) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            max_rows = cfg.reward.leaf_channel.max_rows
            leaf = _leaf_channel(stub, max_rows)
            ways = [(leaf, True), (leaf, False), (RewardServiceEvaluator(ch, "connect4_value", timeout_s=30), False)]
            synchronised = _leaf_channel(stub, max_rows, events=False) if leaf.channel.ordered else None
            if synchronised is not None:  # device waves without events, in the same run
                ways.insert(1, (synchronised, True))
            timed(ways)
            # A second reward service, in this process, for the in_process rows (co-located mode's
            # hand-off): started after the two-process rows, whose process it would share.
            local_cfg = replace(cfg, reward=replace(cfg.reward, address=_free_address()))
            if "in_process" in (args.handoffs or "in_process") or args.serving == "in_process":
                local = reward_server.start(local_cfg, follow_scheduler=False)
                in_process.offer(local_cfg.reward.address, local.servicer.in_process)
                ways = [(_in_process(local_cfg, device=False), False)]
                if local.servicer.in_process.sessions["connect4_value"].orders_by_events:  # a GPU: device links
                    ways[:0] = [(_in_process(local_cfg, device=True), True)]
                timed(ways)
            if profiler:
                out = (args.out or common.RESULTS_DIR) / "neural_search_profile.txt"
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "w") as fh:
                    pstats.Stats(profiler, stream=fh).sort_stats("tottime").print_stats(40)
                profiler.dump_stats(out.with_suffix(".prof"))  # the whole profile, for pstats' callers and callees
                common.note(f"profile of the latency rows: {out}")
            for way in (leaf, synchronised):
                if way is not None:
                    way.channel.close()
            if args.serving == "in_process":  # co-located mode's serving path
                handoff = HandoffEvaluator(ch, "connect4_value", "auto", address=local_cfg.reward.address)
            else:
                handoff = HandoffEvaluator(ch, "connect4_value", "leaf_channel")
            common.note(f"serving path: leaf channel attached: {handoff.wait_attached(10.0)}, device channels: "
                        f"{handoff.wait_device_channels(10.0)}")
            try:
                value_waves = args.value_waves or [cfg.search.value_model_parallel_sims]
                for set_name in SETS if "search_quality" in kinds else ():
                    for name, wave, g in [*(("value_model", w, g) for w in value_waves for g in value_backends),
                                          ("rollout", 256 if variant != common.CPU_VARIANT else cfg.search.parallel_sims,
                                           1)]:
                        # A cache of its own per row: another row's evaluations of the same positions would be hits.
                        cached = CachedEvaluator(handoff, EvaluationCache(cfg.search.evaluation_cache_bytes))
                        row = common.attempt(f"quality {set_name} {name}", quality,
                                             value_backends.get(g, backend), cached, set_name,
                                             8 if args.quick else args.positions, name, wave, 16.0, handoff)
                        if row:
                            row["sims_per_warp"] = g
                            common.progress(row)
                            rows.append(row)
            finally:
                handoff.close()
    finally:
        if local is not None:
            local.stop()
        stop.set()
        service.join(30)
    if args.timeline:
        service_marks = [m for path in glob.glob(os.path.join(timeline.FOLDER, "timeline-*.json"))
                         for m in timeline.load(path)]
        service_gpu = [m for path in glob.glob(os.path.join(timeline.FOLDER, "gpu-timeline-*.json"))
                       for m in timeline.load(path)]
        for wave, g, marks, searches, how, gpu in marked:  # in_process: both services' marks are this process's
            rows += [dict(r, sims_per_warp=g) for r in timeline_rows(wave, marks, service_marks if how == "leaf_channel" else [],
                                                                     searches, how)]
            gpu_rows = [dict(r, kind="gpu_timeline", sims_per_warp=g)
                        for r in timeline_rows(wave, gpu, service_gpu if how == "leaf_channel" else [], searches, how)]
            rows += gpu_rows
    for row in rows:
        row["mps"] = on_mps
    common.finish(BENCHMARK, rows, args.out, COLUMNS)


if __name__ == "__main__":
    main()

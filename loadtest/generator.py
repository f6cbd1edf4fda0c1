"""An open-loop load generator: N game engines at a target frame rate.

Each engine has a frame every ``1 / fps`` s (engines are spread evenly over
the frame period). At its scheduled time a frame sends one ``Search`` (a real
labelled Connect Four position, a fixed simulation budget, ``deadline_ms``
only as a cap) and one ``Evaluate`` of the same position (its board planes,
or with ``frames`` a rendered 224x224 RGB uint8 frame of it,
training/frames.py), both asynchronously: the generator never
waits for answers before sending the next frame (open loop: a slow server
gets more requests in flight, not fewer requests, so its queueing shows).
Latency is measured from the frame's *scheduled* time, not from when the
request left, so the generator's own lateness is counted against the server
rather than hidden (coordinated omission); the generator's send lag is
reported separately.

Every request ends in exactly one of: answered (OK), refused with a status
code (counted by code), or lost (no answer one second past its deadline;
never expected, since every call carries a deadline); until then it is
counted as in flight.

    gen = OpenLoopGenerator(LoadSpec(search_address=..., reward_address=..., engines=4, fps=15))
    report = gen.run(duration_s=60)          # or gen.start(); ...; gen.stop(); gen.report()

Reusable by other load tests: ``records`` holds one :class:`Record` per
request (scheduled / sent / done times, code, the search's evaluator).
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import asdict, dataclass

import grpc
import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from search_service.games import connect4
from tandem import tensors
from tandem.positions import DEFAULT_SETS, load_set
from tandem.server import channel
from training.frames import render_moves

EVALUATORS = {"rollout": search_pb2.EVALUATOR_ROLLOUT, "value_model": search_pb2.EVALUATOR_VALUE_MODEL}


@dataclass
class LoadSpec:
    search_address: str
    reward_address: str
    engines: int = 4
    fps: float = 15.0
    simulations: int = 32  # per search (no deadline_ms: a fixed amount of work per frame)
    evaluator: str = "rollout"  # "rollout" | "value_model"
    model: str = "connect4_value"  # for Evaluate
    evaluate: bool = True  # also send one Evaluate per frame
    timeout_s: float = 2.0  # gRPC deadline of every call
    position_sets: tuple[str, ...] = DEFAULT_SETS
    session_ids: bool = False  # one session id per engine (tree reuse store is exercised)
    seed: int = 1
    deadline_ms: float = 0.0  # cap on each search (0 = none: the simulation budget alone)
    frames: bool = False  # Evaluate a rendered 224x224 frame (model "frame_reward") instead of the board


@dataclass
class Record:
    kind: str  # "search" | "evaluate"
    engine: int
    frame: int
    scheduled: float  # time.monotonic() the frame was due
    sent: float
    done: float | None = None
    code: str | None = None  # "OK" or a StatusCode name; None while in flight
    evaluator: str | None = None  # search answers: EVALUATOR_ROLLOUT / EVALUATOR_VALUE_MODEL
    simulations: int | None = None  # search answers: simulations completed
    server_queue_ms: float | None = None  # evaluate answers: the reward batcher's wait (server-side)
    server_compute_ms: float | None = None  # evaluate answers: the model run of its batch (server-side)


def _percentiles(values) -> dict:
    a = np.asarray(list(values), np.float64)
    if a.size == 0:
        return {"p50": None, "p99": None, "max": None, "mean": None}
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3), "mean": round(float(a.mean()), 3)}


class OpenLoopGenerator:
    """Sends frames on schedule from one thread; answers are counted on gRPC's callback threads."""

    def __init__(self, spec: LoadSpec, cfg=None):
        self.spec = spec
        self._cfg = cfg
        positions = [p for name in spec.position_sets for p in load_set(name)]
        random.Random(spec.seed).shuffle(positions)
        self._positions = [(p.moves, connect4.observation(connect4.parse_moves(p.moves))) for p in positions]
        self._search_ch = channel(spec.search_address, cfg)
        self._reward_ch = channel(spec.reward_address, cfg)
        self._search = search_pb2_grpc.SearchServiceStub(self._search_ch)
        self._reward = reward_pb2_grpc.RewardServiceStub(self._reward_ch)
        self._input_name: str | None = None
        self._lock = threading.Lock()
        self.records: list[Record] = []  # guarded by _lock (appends); fields set once by callbacks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._t_end = 0.0

    # -- running -------------------------------------------------------------------------------
    def start(self, duration_s: float | None = None) -> None:
        """Starts sending in a background thread (until ``stop`` or ``duration_s``)."""
        if self.spec.evaluate and self._input_name is None:
            meta = self._reward.ModelMetadata(reward_pb2.ModelMetadataRequest(model=self.spec.model), timeout=10)
            self._input_name = meta.inputs[0].name
        self._stop.clear()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, args=(duration_s,), name="loadgen", daemon=True)
        self._thread.start()

    def stop(self, drain_s: float | None = None) -> None:
        """Stops sending and waits (up to the call timeout + 1 s) for answers in flight."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._t_end = time.monotonic()
        end = time.monotonic() + (self.spec.timeout_s + 1.0 if drain_s is None else drain_s)
        while time.monotonic() < end and self.in_flight():
            time.sleep(0.01)

    def close(self) -> None:
        self._search_ch.close()
        self._reward_ch.close()

    def run(self, duration_s: float) -> dict:
        """Runs for ``duration_s`` and returns :meth:`report`."""
        self.start(duration_s)
        self._thread.join()
        self.stop()
        return self.report()

    def in_flight(self) -> int:
        with self._lock:
            return sum(r.code is None for r in self.records)

    def _loop(self, duration_s: float | None) -> None:
        spec = self.spec
        period = 1.0 / spec.fps
        k = 0
        while not self._stop.is_set():
            frame_start = self._t0 + k * period
            if duration_s is not None and frame_start - self._t0 >= duration_s:
                return
            for e in range(spec.engines):
                due = frame_start + e * period / spec.engines
                delay = due - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    return
                self._send(e, k, due)
            k += 1

    def _send(self, engine: int, frame: int, due: float) -> None:
        spec = self.spec
        moves, obs = self._positions[(engine * 7919 + frame) % len(self._positions)]
        stones = len(moves)
        phase = search_pb2.GAME_PHASE_EARLY if stones < 12 else (
            search_pb2.GAME_PHASE_MID if stones < 28 else search_pb2.GAME_PHASE_LATE)
        request = search_pb2.SearchRequest(
            game="connect4", moves=moves, simulations=spec.simulations, phase=phase,
            evaluator=EVALUATORS[spec.evaluator], seed=spec.seed * 1_000_003 + frame * 64 + engine + 1,
            session_id=f"engine-{engine}" if spec.session_ids else "", deadline_ms=spec.deadline_ms)
        self._issue(Record("search", engine, frame, due, time.monotonic()),
                    lambda: self._search.Search.future(request, timeout=spec.timeout_s))
        if spec.evaluate:
            if spec.frames:  # what an engine has: its rendered frame, uint8 (~0.2 ms to render)
                obs = render_moves([moves])
            ev = reward_pb2.EvaluateRequest(model=spec.model, inputs=[tensors.to_proto(self._input_name, obs)],
                                            output_names=["value"], request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
            self._issue(Record("evaluate", engine, frame, due, time.monotonic()),
                        lambda: self._reward.Evaluate.future(ev, timeout=spec.timeout_s))

    def _issue(self, rec: Record, make) -> None:
        with self._lock:
            self.records.append(rec)
        try:
            future = make()
        except Exception as exc:  # the channel refused at once (e.g. closed)
            rec.done, rec.code = time.monotonic(), f"SEND_FAILED:{type(exc).__name__}"
            return

        def done(f):
            now = time.monotonic()
            try:
                reply = f.result()
                if rec.kind == "search":
                    rec.evaluator = search_pb2.Evaluator.Name(reply.evaluator)
                    rec.simulations = reply.simulations
                else:
                    rec.server_queue_ms, rec.server_compute_ms = reply.queue_ms, reply.compute_ms
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            except Exception as exc:  # cancelled future
                code = type(exc).__name__
            rec.done = now
            rec.code = code

        future.add_done_callback(done)

    # -- figures ---------------------------------------------------------------------------------
    def report(self, since: float | None = None, until: float | None = None) -> dict:
        """Counts and latencies of the requests scheduled in [since, until) (monotonic; default all)."""
        spec = self.spec
        recs = self._window(since, until)
        out = {"spec": asdict(spec), "duration_s": round((self._t_end or time.monotonic()) - self._t0, 2),
               "frames": len({(r.engine, r.frame) for r in recs}), "requests": {}}
        now = time.monotonic()
        for kind in ("search", "evaluate"):
            rs = [r for r in recs if r.kind == kind]
            codes: dict[str, int] = {}
            for r in rs:
                # No answer yet: in flight while its deadline (+1 s) has not passed, lost after.
                key = r.code or ("LOST" if now - r.sent > spec.timeout_s + 1.0 else "IN_FLIGHT")
                codes[key] = codes.get(key, 0) + 1
            ok = [r for r in rs if r.code == "OK"]
            out["requests"][kind] = {
                "sent": len(rs),
                "answered": len(ok),
                "refused": {k: v for k, v in codes.items() if k not in ("OK", "LOST", "IN_FLIGHT")},
                "lost": codes.get("LOST", 0),
                "in_flight": codes.get("IN_FLIGHT", 0),
                "latency_from_schedule_ms": _percentiles((r.done - r.scheduled) * 1e3 for r in ok),
                "send_lag_ms": _percentiles((r.sent - r.scheduled) * 1e3 for r in rs),
            }
            if kind == "search":
                evs: dict[str, int] = {}
                for r in ok:
                    evs[r.evaluator] = evs.get(r.evaluator, 0) + 1
                out["requests"][kind]["evaluators"] = evs
            else:  # what the reward service reports, to tell its queue from the rest of the path
                out["requests"][kind]["server_queue_ms"] = _percentiles(r.server_queue_ms for r in ok)
                out["requests"][kind]["server_compute_ms"] = _percentiles(r.server_compute_ms for r in ok)
        frames = _by_frame(recs)
        complete = _complete_frames_ms(frames)
        out["frame_latency_ms"] = _percentiles(complete)
        # A frame is missed when it is not complete within its period (1 / fps), or not complete at all.
        out["missed_frames"] = sum(x > 1000.0 / spec.fps for x in complete) + (len(frames) - len(complete))
        out["missed_frame_share"] = round(out["missed_frames"] / len(frames), 4) if frames else None
        sims = [r.simulations for r in recs if r.kind == "search" and r.code == "OK"]
        out["simulations_per_frame"] = round(float(np.mean(sims)), 1) if sims else None
        return out

    def _window(self, since: float | None, until: float | None) -> list[Record]:
        """The records of requests scheduled in [since, until) (monotonic; None: unbounded)."""
        with self._lock:
            return [r for r in self.records
                    if (since is None or r.scheduled >= since) and (until is None or r.scheduled < until)]

    def frame_latencies_ms(self, since: float | None = None, until: float | None = None) -> list[float]:
        """Latency of every complete frame (all its requests OK) scheduled in
        [since, until) (monotonic; default all), from its schedule, in ms."""
        recs = self._window(since, until)
        return _complete_frames_ms(_by_frame(recs))


def _by_frame(recs: list[Record]) -> dict[tuple[int, int], list[Record]]:
    frames: dict[tuple[int, int], list[Record]] = {}
    for r in recs:
        frames.setdefault((r.engine, r.frame), []).append(r)
    return frames


def _complete_frames_ms(frames: dict[tuple[int, int], list[Record]]) -> list[float]:
    """Latency (ms, from the schedule to the last answer) of each frame whose requests all succeeded."""
    return [(max(r.done for r in rs) - rs[0].scheduled) * 1e3 for rs in frames.values()
            if all(r.code == "OK" for r in rs)]


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.generator --search HOST:PORT --reward HOST:PORT [...]`` against a running stack."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.generator", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="tandem config (addresses, TLS, token); default deploy/config/tandem.yaml")
    ap.add_argument("--search"), ap.add_argument("--reward")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--fps", type=float, default=15.0)
    ap.add_argument("--simulations", type=int, default=32)
    ap.add_argument("--evaluator", choices=sorted(EVALUATORS), default="rollout")
    ap.add_argument("--deadline-ms", type=float, default=0.0, help="cap on each search (default: none)")
    ap.add_argument("--frames", action="store_true", help="Evaluate rendered 224x224 frames (model frame_reward)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", help="write the report as JSON here")
    args = ap.parse_args(argv)
    from tandem.config import load_config

    cfg = load_config(args.config)
    gen = OpenLoopGenerator(LoadSpec(args.search or cfg.search.address, args.reward or cfg.reward.address,
                                     engines=args.engines, fps=args.fps, simulations=args.simulations,
                                     evaluator=args.evaluator, deadline_ms=args.deadline_ms, frames=args.frames,
                                     model="frame_reward" if args.frames else "connect4_value"), cfg)
    try:
        report = gen.run(args.seconds)
    finally:
        gen.close()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    lost_or_failed = sum(v["lost"] + sum(v["refused"].values()) for v in report["requests"].values())
    return 1 if lost_or_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

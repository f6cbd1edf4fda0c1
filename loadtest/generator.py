"""An open-loop load generator: N game engines at a target frame rate.

Each engine has a frame every ``1 / fps`` s (engines are spread evenly over
the frame period; the pacing, requests and frame timing are the engine's own
frame loop, stack/frame_loop.py). At its scheduled time a frame sends one ``Search`` (a real
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

Reusable by other load tests: ``records`` holds one
:class:`stack.frame_loop.Record` per request (scheduled / sent / done times,
code, the search's evaluator).
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from stack.frame_loop import (
    EVALUATORS,
    FrameClient,
    Record,
    Tick,
    board_observation,
    frame_budget_ms,
    frame_latency_ms,
    missed_frames,
    paced,
    shuffled_positions,
)
from stack.stats import summary
from tandem.positions import DEFAULT_SETS
from training.frames import render_moves


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


class OpenLoopGenerator:
    """Sends frames on schedule from one thread; answers are counted on gRPC's callback threads."""

    def __init__(self, spec: LoadSpec, cfg=None):
        self.spec = spec
        self._positions = [(p.moves, board_observation(p.moves))
                           for p in shuffled_positions(spec.position_sets, spec.seed)]
        self._client = FrameClient(spec.search_address, spec.reward_address, cfg, model=spec.model)
        self._lock = threading.Lock()
        self.records: list[Record] = []  # guarded by _lock (appends); fields set once by callbacks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._t_end = 0.0

    # -- running -------------------------------------------------------------------------------
    def start(self, duration_s: float | None = None) -> None:
        """Starts sending in a background thread (until ``stop`` or ``duration_s``).

        Raises:
            grpc.RpcError: (with ``spec.evaluate``) the model's metadata could not be read.
        """
        if self.spec.evaluate:
            self._client.metadata()  # fails here, not on the sending thread
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
        self._client.close()

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
        for tick in paced(self.spec.fps, engines=self.spec.engines, duration_s=duration_s, start=self._t0,
                          stop=self._stop):
            self._send(tick)

    def _send(self, tick: Tick) -> None:
        spec = self.spec
        moves, obs = self._positions[(tick.engine * 7919 + tick.frame) % len(self._positions)]
        evaluate = None
        if spec.evaluate:
            # What an engine has: its rendered frame, uint8 (~0.2 ms to render), or the board planes.
            evaluate = (lambda: render_moves([moves])) if spec.frames else (lambda: obs)
        frame = self._client.send(
            tick, moves, simulations=spec.simulations, evaluator=spec.evaluator,
            seed=spec.seed * 1_000_003 + tick.frame * 64 + tick.engine + 1,
            session_id=f"engine-{tick.engine}" if spec.session_ids else "", deadline_ms=spec.deadline_ms,
            timeout_s=spec.timeout_s, evaluate=evaluate)
        with self._lock:
            self.records.extend(frame.records)

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
                "latency_from_schedule_ms": summary((r.done - r.scheduled) * 1e3 for r in ok),
                "send_lag_ms": summary((r.sent - r.scheduled) * 1e3 for r in rs),
            }
            if kind == "search":
                evs: dict[str, int] = {}
                for r in ok:
                    evs[r.evaluator] = evs.get(r.evaluator, 0) + 1
                out["requests"][kind]["evaluators"] = evs
            else:  # what the reward service reports, to tell its queue from the rest of the path
                out["requests"][kind]["server_queue_ms"] = summary(r.server_queue_ms for r in ok)
                out["requests"][kind]["server_compute_ms"] = summary(r.server_compute_ms for r in ok)
        frames = _by_frame(recs)
        complete = _complete_frames_ms(frames)
        out["frame_latency_ms"] = summary(complete)
        # A frame is missed when it is not complete within its period (1 / fps), or not complete at all.
        out["missed_frames"] = missed_frames(complete, frame_budget_ms(spec.fps)) + (len(frames) - len(complete))
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
    latencies = (frame_latency_ms(rs, since=rs[0].scheduled) for rs in frames.values())
    return [x for x in latencies if x is not None]


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

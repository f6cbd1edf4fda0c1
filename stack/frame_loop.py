"""A game engine's frame loop, shared by ``tandem play`` (stack/play.py) and
the open-loop load generator (loadtest/generator.py).

* Pacing: an engine has a frame every ``1 / fps`` s, N engines spread evenly
  over the period (:func:`paced`); a late frame starts at once, so the
  schedule does not drift.
* The requests: a frame sends one ``Search`` of a Connect Four position and,
  optionally, one ``Evaluate`` of it, both at once (:meth:`FrameClient.send`);
  each request's times and outcome land in a :class:`Record` when its answer
  comes.
* Timing and the deadline: a frame's latency runs from a reference time (its
  schedule, or when it was sent) to its last answer (:func:`frame_latency_ms`);
  it is missed past its budget, the frame period ``1000 / fps`` ms
  (:func:`frame_budget_ms`, :func:`missed_frames`).

Times are ``time.monotonic()`` seconds; latencies and budgets are ms.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from search_service.games import connect4
from tandem import tensors
from tandem.failover import STANDBY_KEY, Failover
from tandem.positions import LabelledPosition, load_set
from tandem.server import channel

# "auto": the request names none, and the search service's search.evaluator decides
EVALUATORS = {"auto": search_pb2.EVALUATOR_UNSPECIFIED, "rollout": search_pb2.EVALUATOR_ROLLOUT,
              "value_model": search_pb2.EVALUATOR_VALUE_MODEL}


# -- the per-frame deadline ------------------------------------------------------------------------
def frame_budget_ms(fps: float) -> float:
    """A frame's budget in ms: its period, ``1000 / fps``.

    Raises:
        ZeroDivisionError: ``fps`` is 0.
    """
    return 1000.0 / fps


def missed_frames(latencies_ms: Iterable[float], budget_ms: float) -> int:
    """How many frame latencies (ms) exceed the frame budget (ms)."""
    return sum(x > budget_ms for x in latencies_ms)


# -- positions ---------------------------------------------------------------------------------------
def shuffled_positions(position_sets: Iterable[str], seed: int) -> list[LabelledPosition]:
    """The labelled positions of ``position_sets``, in an order fixed by ``seed``.

    Raises:
        FileNotFoundError / ValueError: from ``tandem.positions.load_set`` (an unknown set).
    """
    positions = [p for name in position_sets for p in load_set(name)]
    random.Random(seed).shuffle(positions)
    return positions


def board_observation(moves: str) -> np.ndarray:
    """The value model's input for the position after ``moves`` (its board planes)."""
    return connect4.observation(connect4.parse_moves(moves))


def game_phase(stones: int) -> int:
    """The search's ``GamePhase`` for a position with ``stones`` stones on the board."""
    if stones < 12:
        return search_pb2.GAME_PHASE_EARLY
    return search_pb2.GAME_PHASE_MID if stones < 28 else search_pb2.GAME_PHASE_LATE


# -- pacing ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tick:
    """One engine's frame, due at ``due`` (monotonic s)."""

    engine: int
    frame: int
    due: float


def paced(fps: float, *, engines: int = 1, frames: int | None = None, duration_s: float | None = None,
          start: float | None = None, stop: threading.Event | None = None,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Iterator[Tick]:
    """Yields each engine's frame when it is due: frame ``k`` of engine ``e`` at
    ``start + (k + e / engines) / fps`` s (monotonic; ``start`` defaults to now).

    Ends after ``frames`` frames per engine, at the first frame due ``duration_s``
    or more after ``start``, or when ``stop`` is set (checked before each round of
    engines and while waiting); None: no such bound. A late frame is yielded at
    once rather than shifting the ones after it, so a slow consumer is not hidden.
    ``clock`` and ``sleep`` (without ``stop``; with it, ``stop.wait``) are the
    time it reads and how it waits (tests pass a fake clock).

    Raises:
        ValueError: ``engines`` < 1.
        ZeroDivisionError: ``fps`` is 0.
    """
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    period = 1.0 / fps
    t0 = clock() if start is None else start
    k = 0
    while (frames is None or k < frames) and not (stop is not None and stop.is_set()):
        frame_start = t0 + k * period
        if duration_s is not None and frame_start - t0 >= duration_s:
            return
        for e in range(engines):
            due = frame_start + e * period / engines
            delay = due - clock()
            if delay > 0:
                if stop is None:
                    sleep(delay)
                elif stop.wait(delay):
                    return
            yield Tick(e, k, due)
        k += 1


# -- a frame's requests -------------------------------------------------------------------------------
@dataclass
class Record:
    """One request of a frame: when it was due and sent, and how it ended."""

    kind: str  # "search" | "search_batch" (one call for an engine's agents) | "evaluate"
    engine: int
    frame: int
    scheduled: float  # time.monotonic() the frame was due
    sent: float  # time.monotonic() the request left
    done: float | None = None  # time.monotonic() its answer (or error) came; None while in flight
    code: str | None = None  # "OK" or a StatusCode name; None while in flight
    detail: str = ""  # a failure's message (the status details), else ""
    evaluator: str | None = None  # search answers: EVALUATOR_ROLLOUT / EVALUATOR_VALUE_MODEL
    simulations: int | None = None  # search answers: simulations completed
    server_queue_ms: float | None = None  # evaluate answers: the reward batcher's wait (server-side)
    server_compute_ms: float | None = None  # evaluate answers: the model run of its batch (server-side)
    server: str = ""  # evaluate answers: "primary" (the reward service) or "standby" (tandem/failover.py)


def frame_latency_ms(records: list[Record], since: float) -> float | None:
    """ms from ``since`` (monotonic s) to a frame's last answer; None unless all
    its requests were answered OK."""
    if not all(r.code == "OK" for r in records):
        return None
    return (max(r.done for r in records) - since) * 1e3


@dataclass
class SentFrame:
    """A frame's requests, in flight: their records (filled as answers come) and calls."""

    tick: Tick
    expected: int  # requests the frame sends
    records: list[Record] = field(default_factory=list)
    calls: list[futures.Future | None] = field(default_factory=list)  # None: the send itself failed
    _answered: threading.Event = field(default_factory=threading.Event, repr=False)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until every request has its outcome (or ``timeout_s``); True if they all have."""
        return self._answered.wait(timeout_s)

    def failed(self) -> Record | None:
        """The first request that is not OK (search first: its ``code``, ``kind``, ``detail``); None if all are OK."""
        return next((r for r in self.records if r.code != "OK"), None)

    def failure(self) -> str | None:
        """The first request's code that is not OK (search first); None if all are OK."""
        rec = self.failed()
        return None if rec is None else rec.code

    def replies(self) -> list:
        """The answers, in the order sent (after :meth:`wait` and no :meth:`failure`).

        Raises:
            grpc.RpcError: a call failed.
        """
        return [c.result() for c in self.calls]

    def _track(self, rec: Record, make: Callable[[], futures.Future]) -> None:
        self.records.append(rec)
        try:
            call = make()
        except Exception as exc:  # the channel refused at once (e.g. closed)
            self.calls.append(None)
            self._finish(rec, f"SEND_FAILED:{type(exc).__name__}")
            return
        self.calls.append(call)
        call.add_done_callback(lambda f: self._answer(rec, f))

    def _answer(self, rec: Record, f: futures.Future) -> None:
        """On the call's thread -- or on the sending thread, when the call
        was done before its callback was added: the record's outcome and the
        reply's own figures. The record is finished whatever is raised here (a
        Ctrl-C's KeyboardInterrupt lands in whatever the main thread runs, and
        gRPC swallows what a callback raises): else the frame's wait never ends."""
        code = "INTERRUPTED"
        try:
            reply = f.result()
            if rec.kind == "search":
                rec.evaluator = search_pb2.Evaluator.Name(reply.evaluator)
                rec.simulations = reply.simulations
            elif rec.kind == "search_batch":  # an engine's agents: the least searched of them
                rec.evaluator = search_pb2.Evaluator.Name(reply.results[0].evaluator)
                rec.simulations = min(r.simulations for r in reply.results)
            else:
                rec.server_queue_ms, rec.server_compute_ms = reply.queue_ms, reply.compute_ms
                rec.server = getattr(f, "server", "primary")
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            rec.detail = getattr(exc, "details", lambda: "")() or ""  # a grpc.Call's; RpcError itself has none
        except Exception as exc:  # cancelled future
            code = type(exc).__name__
        finally:
            self._finish(rec, code)

    def _finish(self, rec: Record, code: str) -> None:
        rec.done = time.monotonic()
        rec.code = code
        # Each record's outcome is written before this check, so the last one to finish sees them all
        # (and a search answered before the Evaluate left does not end the wait).
        if len(self.records) == self.expected and all(r.code is not None for r in self.records):
            self._answered.set()


CLOSE_TIMEOUT_S = 2.0  # a channel's close takes milliseconds; beyond this it is stuck
# A client's calls run blocking on long-lived threads of its own, made as needed up to this
# many (the most calls in flight at once; more wait for a thread). A grpc future on a channel
# with no call in flight starts a thread to poll that channel, a thread a call at 60 FPS:
# starting and polling them was ~70 % of an engine's CPU (py-spy, tandem play, rollouts).
CALL_THREADS = 256


class FrameClient:
    """An engine's connections to the search and reward services: a frame's
    ``Search`` and ``Evaluate``, sent at once. The Evaluate goes to the reward
    service's standby while the reward service is down, where the reward
    service names one (``ModelMetadata.runtime["standby_server"]``; tandem/failover.py)."""

    def __init__(self, search_address: str, reward_address: str, cfg=None, *, model: str = "connect4_value"):
        """``cfg``: the tandem config whose TLS and token the channels use (None: plaintext)."""
        self.model = model
        self._cfg = cfg
        self._search_ch = channel(search_address, cfg)
        self._reward_ch = channel(reward_address, cfg)
        self._standby_ch: grpc.Channel | None = None  # opened with the metadata, where it names a standby
        self._search = search_pb2_grpc.SearchServiceStub(self._search_ch)
        self._reward = reward_pb2_grpc.RewardServiceStub(self._reward_ch)
        self._metadata: reward_pb2.ModelMetadataResponse | None = None
        self._evaluate: Failover | None = None
        self._calls = futures.ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="engine-call")
        self._search_one, self._search_batch = self._future(self._search.Search), self._future(self._search.SearchBatch)

    def _future(self, method: grpc.UnaryUnaryMultiCallable) -> Callable[..., futures.Future]:
        """``method`` as ``(request, timeout) -> Future`` of its blocking call on the client's threads
        (its result: the reply, or the grpc.RpcError it raised)."""
        return lambda request, timeout: self._calls.submit(method, request, timeout=timeout)

    def metadata(self) -> reward_pb2.ModelMetadataResponse:
        """The value model's metadata (asked once, 10 s deadline); opens the
        channel to the reward service's standby, where it names one.

        Raises:
            grpc.RpcError: ModelMetadata failed (the reward service is down, the model unknown).
        """
        if self._metadata is None:
            self._metadata = self._reward.ModelMetadata(reward_pb2.ModelMetadataRequest(model=self.model), timeout=10)
            standby = self._metadata.runtime.get(STANDBY_KEY, "")
            if standby:
                self._standby_ch = channel(standby, self._cfg)
            self._evaluate = Failover(self._future(self._reward.Evaluate), self._future(
                reward_pb2_grpc.RewardServiceStub(self._standby_ch).Evaluate) if self._standby_ch is not None else None)
        return self._metadata

    def send(self, tick: Tick, moves: str | list[str], *, simulations: int, evaluator: str, seed: int,
             timeout_s: float, session_id: str = "", deadline_ms: float = 0.0,
             evaluate: Callable[[], np.ndarray] | None = None, game: str = connect4.NAME) -> SentFrame:
        """Sends the frame's ``Search`` of the position after ``moves`` and, with
        ``evaluate``, an ``Evaluate`` (request class critical) of the array it returns;
        neither waits for an answer. ``moves`` a list: one ``SearchBatch`` of
        those positions instead (an engine's agents; agent j's seed is ``seed +
        j``, its session ``session_id-j``).

        ``simulations`` 0: the ``deadline_ms`` alone bounds the search; ``deadline_ms``
        0: the simulations alone; ``timeout_s``: the gRPC deadline of both calls;
        ``game``: the game searched (``moves`` in its notation; the game phase
        is sent for Connect Four, whose move strings count its stones).
        ``evaluate`` is called once the search has left (an engine's frame render
        then costs the Evaluate, not the Search).

        Raises:
            ValueError: ``evaluator`` is not one of :data:`EVALUATORS`.
            grpc.RpcError: (with ``evaluate``) the model's metadata could not be read.
        """
        if evaluator not in EVALUATORS:
            raise ValueError(f"evaluator: must be one of {sorted(EVALUATORS)}, got {evaluator!r}")
        def request(m: str, j: int | None = None) -> search_pb2.SearchRequest:
            return search_pb2.SearchRequest(
                game=game, moves=m, simulations=simulations, deadline_ms=deadline_ms,
                phase=game_phase(len(m)) if game == connect4.NAME else search_pb2.GAME_PHASE_UNSPECIFIED,
                evaluator=EVALUATORS[evaluator], seed=seed + (j or 0),
                session_id=f"{session_id}-{j}" if session_id and j is not None else session_id)

        frame = SentFrame(tick, expected=1 if evaluate is None else 2)
        if isinstance(moves, str):
            frame._track(Record("search", tick.engine, tick.frame, tick.due, time.monotonic()),
                         lambda: self._search_one(request(moves), timeout_s))
        else:
            batch = search_pb2.SearchBatchRequest(searches=[request(m, j) for j, m in enumerate(moves)])
            frame._track(Record("search_batch", tick.engine, tick.frame, tick.due, time.monotonic()),
                         lambda: self._search_batch(batch, timeout_s))
        if evaluate is not None:
            ev = reward_pb2.EvaluateRequest(
                model=self.model, inputs=[tensors.to_proto(self.metadata().inputs[0].name, evaluate())],
                output_names=["value"], request_class=reward_pb2.REQUEST_CLASS_CRITICAL)
            frame._track(Record("evaluate", tick.engine, tick.frame, tick.due, time.monotonic()),
                         lambda: self._evaluate.future(ev, timeout_s))
        return frame

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Closes both channels, waiting at most ``timeout_s`` for each: after
        a Ctrl-C whose KeyboardInterrupt landed inside gRPC's own code, a
        channel's close can wait for ever (seen under a loaded CPU: `tandem
        play` held up in grpc's Channel.close until its exit deadline), and a
        command that is exiting need not wait for it."""
        self._calls.shutdown(wait=False)
        for ch in (self._search_ch, self._reward_ch, *([self._standby_ch] if self._standby_ch else [])):
            closing = threading.Thread(target=ch.close, name="channel-close", daemon=True)
            closing.start()
            closing.join(timeout_s)

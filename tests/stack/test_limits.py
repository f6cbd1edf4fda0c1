"""Limits: overload is refused at once with RESOURCE_EXHAUSTED instead of
queueing without bound; queues and tables are bounded; a search whose caller
has gone (cancelled, or past its gRPC deadline) stops between waves and frees
its thread. Figures go to ``runs/reliability/limits.json``."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import loopback_config
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc, search_pb2, search_pb2_grpc

from loadtest.reliability_figures import (
    CancelFigures,
    ClientDeadlineFigures,
    FloodFigures,
    LimitsFigures,
    SessionsFigures,
    WatchStreamsFigures,
    save_figures,
)
from scheduler.main import start as start_scheduler
from search_service import server as search_server
from search_service.games import connect4
from search_service.mcts.backend import SearchParams
from search_service.mcts.cpu_reference import CpuReferenceBackend, CpuTreeBatch
from tandem.device import cpu_only

C = grpc.StatusCode
FIGURES = LimitsFigures()  # each test fills its part


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    if FIGURES != LimitsFigures():
        save_figures(FIGURES)


class RecordingBackend:
    """The CPU backend, recording each search's simulations, waves and whether
    it was stopped, as the search service runs it (in its wave loop's batch)."""

    name = "cpu_reference"

    def __init__(self):
        self.inner = CpuReferenceBackend()
        self.calls: list[dict] = []
        self.started = threading.Event()
        self.finished = threading.Event()

    def search(self, roots, params, evaluator=None, trees=None, *, should_stop=None):
        return self.inner.search(roots, params, evaluator, trees, should_stop=should_stop)

    def open_batch(self, params, evaluator=None):
        return RecordingBatch(self, params, evaluator)

    def reroot(self, tree, actions):
        return self.inner.reroot(tree, actions)


class RecordingBatch(CpuTreeBatch):
    def __init__(self, owner: RecordingBackend, params, evaluator):
        super().__init__(params, evaluator)
        self.owner = owner

    def join(self, roots, trees, seeds, streams):
        self.owner.started.set()
        return super().join(roots, trees, seeds, streams)

    def leave(self, rows, members):
        results, trees, kept = super().leave(rows, members)
        for r, m in zip(results, members):
            self.owner.calls.append({"simulations": r.simulations, "waves": r.extras["waves"],
                                     "stopped": r.extras["stopped"], "budget": m.simulations,
                                     "deadline_ms": m.owner.params.deadline_ms})
        self.owner.finished.set()
        return results, trees, kept


def _search_server(**search):
    cfg = loopback_config(search={"backend": "cpu", **search})
    service = search_server.start(cfg, follow_scheduler=False)
    backend = RecordingBackend()
    service.servicer.backend = backend
    ch = grpc.insecure_channel(cfg.search.address)
    return service, backend, ch, search_pb2_grpc.SearchServiceStub(ch)


# -- the backend's should_stop ---------------------------------------------------------------------------
def test_should_stop_is_checked_between_waves():
    backend, pos = CpuReferenceBackend(), connect4.parse_moves("44")
    calls = []

    def stop_after_three():
        calls.append(1)
        return len(calls) >= 3

    params = SearchParams(simulations=10_000, deadline_ms=None, parallel_sims=8, seed=1)
    (r,), _ = backend.search(pos, params, should_stop=stop_after_three)
    # Checked before every wave after the first: waves 2 and 3 ran, the third check stopped wave 4.
    assert r.extras == {"waves": 3, "stopped": True} and r.simulations == 24
    assert connect4.legal_mask(pos)[0][r.action]  # still a usable answer
    (full,), _ = backend.search(pos, SearchParams(simulations=40, deadline_ms=None, parallel_sims=8, seed=1),
                                should_stop=lambda: False)
    assert full.simulations == 40 and not full.extras["stopped"]
    (default,), _ = backend.search(pos, SearchParams(simulations=40, deadline_ms=None, parallel_sims=8, seed=1))
    assert list(default.visit_counts) == list(full.visit_counts)  # None changes nothing


# -- overload ------------------------------------------------------------------------------------------------
def test_flood_is_refused_fast_and_the_admitted_are_answered():
    """40 concurrent 1-s searches at a server taking 4 RPCs in flight (2 threads):
    the excess is refused with RESOURCE_EXHAUSTED at once, every admitted one is
    answered, and health answers SERVING meanwhile (it has threads of its own)."""
    limit, flood, search_ms = 4, 40, 1000
    service, backend, ch, stub = _search_server(server={"max_workers": 2, "max_concurrent_rpcs": limit})
    try:
        stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=8), timeout=30)  # connected, warm
        request = search_pb2.SearchRequest(game="connect4", moves="44", deadline_ms=search_ms)
        began = time.perf_counter()
        done: dict[int, tuple[C, float]] = {}
        lock = threading.Lock()

        def finished(i):
            def cb(f):
                code = f.code() if f.exception() is not None else C.OK
                with lock:
                    done[i] = (code, time.perf_counter() - began)
            return cb

        calls = []
        for i in range(flood):
            f = stub.Search.future(request, timeout=30)
            f.add_done_callback(finished(i))
            calls.append(f)
        # A health probe while saturated: health is outside admission, on its own threads (tandem/guard.py).
        time.sleep(0.05)
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            probe = "SERVING"
        except grpc.RpcError as exc:
            probe = exc.code().name
        for f in calls:
            try:
                f.result(timeout=30)
            except grpc.RpcError:
                pass
        codes = [done[i][0] for i in range(flood)]
        answered = [t for c, t in done.values() if c == C.OK]
        refused = [t for c, t in done.values() if c == C.RESOURCE_EXHAUSTED]
        assert set(codes) <= {C.OK, C.RESOURCE_EXHAUSTED}, codes
        assert len(answered) + len(refused) == flood  # nothing lost, nothing else
        # The 4 slots go to the first searches to arrive (on a slow machine the probe below may take one).
        assert limit - 1 <= len(answered) <= flood // 2 and len(refused) >= flood // 2
        assert max(refused) < min(answered)  # refusals come back before any 1-s search ends
        assert probe == "SERVING"
        details = [f.details() for f in calls if f.code() == C.RESOURCE_EXHAUSTED]
        assert all(d for d in details)
        # ... and the server serves normally once the flood has drained.
        assert stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=8), timeout=30).simulations == 8
        FIGURES.flood = FloodFigures(
            search_deadline_ms=search_ms, max_concurrent_rpcs=limit, max_workers=2, sent=flood, answered=len(answered),
            refused_resource_exhausted=len(refused), lost=flood - len(answered) - len(refused),
            refused_latency_ms_max=round(max(refused) * 1e3, 1),
            answered_latency_ms_min=round(min(answered) * 1e3, 1),
            answered_latency_ms_max=round(max(answered) * 1e3, 1),
            health_probe_while_saturated=probe,
        )
    finally:
        ch.close()
        service.stop()


def test_watch_streams_are_bounded_and_unary_calls_still_served():
    """Each WatchAssignments stream holds a server thread: past max_workers - 4 open
    streams the next is refused (RESOURCE_EXHAUSTED), and unary RPCs keep their threads."""
    cfg = loopback_config(scheduler={"server": {"max_workers": 6}})
    handle = start_scheduler(cfg, device=cpu_only())
    ch = grpc.insecure_channel(cfg.scheduler.address)
    stub = scheduler_pb2_grpc.SchedulerStub(ch)
    streams = []
    try:
        for i in range(3):
            lease = stub.Register(scheduler_pb2.RegisterRequest(
                kind=scheduler_pb2.SERVICE_KIND_SEARCH, instance=f"w{i}", address="127.0.0.1:1", pid=1), timeout=5)
            call = stub.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease.lease.lease_id), timeout=10)
            streams.append(call)
        assert next(streams[0]).lease_id and next(streams[1]).lease_id  # two streams: 6 workers - 4 reserved
        with pytest.raises(grpc.RpcError) as info:
            next(streams[2])
        assert info.value.code() == C.RESOURCE_EXHAUSTED and "watch streams" in info.value.details()
        for _ in range(10):  # unary calls are still answered at once
            assert len(stub.Status(scheduler_pb2.StatusRequest(), timeout=2).services) == 3
        FIGURES.watch_streams = WatchStreamsFigures(max_workers=6, streams_admitted=2, third_stream="RESOURCE_EXHAUSTED")
    finally:
        for call in streams:
            call.cancel()
        ch.close()
        handle.stop(grace_ms=0)


def test_sessions_are_bounded_and_session_ids_are_capped():
    service, backend, ch, stub = _search_server(max_sessions=4)
    games = 12
    try:
        for i in range(games):
            stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=8, session_id=f"g{i}"), timeout=10)
        assert len(service.servicer.sessions) == 4
        with pytest.raises(grpc.RpcError) as info:
            stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=8, session_id="x" * 257), timeout=10)
        assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("session_id:")
        assert stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=8,
                                                    session_id="x" * 256), timeout=10).simulations == 8
        FIGURES.sessions = SessionsFigures(games=games, max_sessions=4, kept_after_games=len(service.servicer.sessions),
                                           max_session_id_chars=search_server.MAX_SESSION_ID_CHARS)
    finally:
        ch.close()
        service.stop()


# -- deadlines and cancellation, end to end -------------------------------------------------------------------
BIG = 5_000_000  # simulations: minutes of CPU search if nothing stopped it
CANCEL_AFTER_S = 0.3  # the client cancels its search this long after the search started


def test_cancelled_search_stops_and_frees_its_thread():
    """A client cancels a search of 5 million simulations: the search stops
    at the next wave, and the server's only worker thread serves the next call."""
    service, backend, ch, stub = _search_server(max_simulations=BIG, server={"max_workers": 1})
    try:
        call = stub.Search.future(search_pb2.SearchRequest(game="connect4", moves="44", simulations=BIG))
        assert backend.started.wait(10)
        time.sleep(CANCEL_AFTER_S)  # searching now
        cancelled_at = time.perf_counter()
        call.cancel()
        assert backend.finished.wait(10), "the search did not stop"
        stopped_after_s = time.perf_counter() - cancelled_at
        rec = backend.calls[0]
        assert rec["stopped"] and rec["simulations"] < BIG // 10, rec
        # The one worker thread is free again: the next search is served.
        r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=16), timeout=10)
        assert r.simulations == 16
        for _ in range(100):
            if service.servicer.cancelled:
                break
            time.sleep(0.01)
        assert service.servicer.cancelled == 1
        FIGURES.cancel = CancelFigures(budget_simulations=BIG, cancelled_after_ms=CANCEL_AFTER_S * 1e3,
                                       simulations_done=rec["simulations"], waves=rec["waves"],
                                       stopped_after_cancel_ms=round(stopped_after_s * 1e3, 1))
    finally:
        ch.close()
        service.stop()


def test_client_deadline_bounds_the_search():
    """With only a gRPC deadline (0.5 s) and no budget of its own past 5 million
    simulations, the search ends by the caller's deadline and frees its thread."""
    service, backend, ch, stub = _search_server(max_simulations=BIG, server={"max_workers": 1})
    try:
        began = time.perf_counter()
        try:
            r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="44", simulations=BIG), timeout=0.5)
            outcome = "OK"
            assert r.deadline_reached and r.simulations < BIG
        except grpc.RpcError as exc:
            outcome = exc.code().name
            assert exc.code() == C.DEADLINE_EXCEEDED
        assert backend.finished.wait(5)
        rec = backend.calls[0]
        assert rec["simulations"] < BIG // 10 and rec["deadline_ms"] is not None and rec["deadline_ms"] <= 500
        r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=16), timeout=10)
        assert r.simulations == 16
        FIGURES.client_deadline = ClientDeadlineFigures(
            grpc_timeout_ms=500, outcome=outcome, simulations_done=rec["simulations"],
            search_deadline_ms=round(rec["deadline_ms"], 1),
            answered_after_ms=round((time.perf_counter() - began) * 1e3, 1))
    finally:
        ch.close()
        service.stop()


def test_value_model_search_whose_caller_cancels_stops_too():
    """The same with the value-model evaluator and no reward service (the model
    fails at the root, the search goes on in its tree with rollouts): still stopped."""
    service, backend, ch, stub = _search_server(max_simulations=BIG, evaluator="value_model")
    try:
        call = stub.Search.future(search_pb2.SearchRequest(game="connect4", moves="44", simulations=BIG))
        assert backend.started.wait(10)
        time.sleep(0.3)
        call.cancel()
        assert backend.finished.wait(10)
        assert backend.calls[-1]["stopped"] and backend.calls[-1]["simulations"] < BIG // 10
    finally:
        ch.close()
        service.stop()

"""Every search ends in time and keeps bounded state (issue 13, kinds 2 and 3):
a search answers OK with its best move by the caller's gRPC deadline (the
search's own deadline is that less a reply margin, and no wave starts that is
expected to end past it), a search without a deadline stops at
``search.max_deadline_ms``, and the trees kept for reuse hold at most
``search.max_session_bytes``. Nothing here depends on the machine's speed:
budgets of millions of simulations against deadlines of seconds."""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from search_service import server as search_server
from search_service.budget import REPLY_MARGIN_MAX_MS, search_deadline_ms
from search_service.games import connect4
from search_service.mcts.backend import SearchParams
from search_service.mcts.cpu_reference import CpuReferenceBackend
from search_service.sessions import SessionStore, tree_bytes
from tandem.server import channel

HUGE = 10_000_000  # simulations: hours of CPU search if nothing stopped it


# -- the search's own deadline -------------------------------------------------------------------

@pytest.mark.parametrize("requested_ms, remaining_s, expected_ms", [
    (0.0, None, 60_000.0),  # no deadline anywhere: the service's limit
    (500.0, None, 500.0),  # the request's own
    (0.0, 2.0, 2000.0 - REPLY_MARGIN_MAX_MS),  # the gRPC deadline less the margin (50 ms at most)
    (0.0, 0.1, 85.0),  # ... 15 % of a short one
    (0.0, 0.0167, 16.7 * 0.85),
    (0.0, 0.005, 3.0),  # ... and at least 2 ms
    (100.0, 10.0, 100.0),  # the nearer of the two
    (0.0, -1.0, 0.1),  # already past: one wave, then the answer
    (0.0, 1e9, 60_000.0),  # "no deadline" reported as years left
])
def test_search_deadline_is_the_nearest_bound_less_a_reply_margin(requested_ms, remaining_s, expected_ms):
    assert search_deadline_ms(requested_ms, remaining_s, 60_000.0) == pytest.approx(expected_ms)


class _SlowModel:
    """A leaf evaluator whose every call takes ``seconds`` (a value model on a
    slow link): waves long against the deadline, so when the search stops is
    visible at a scale no machine's speed blurs."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, obs):
        time.sleep(self.seconds)
        return np.zeros(len(obs), np.float32), None


def test_no_wave_starts_that_would_end_past_the_deadline():
    """Root valued at ~0.4 s, waves end at ~0.8, 1.2, 1.6 s; a fourth would end
    at ~2.0 s, past the 1.9 s deadline, so the search answers at ~1.6 s (it
    used to start that wave and answer at ~2.0 s)."""
    params = SearchParams(simulations=HUGE, deadline_ms=1900.0, parallel_sims=4, evaluator="value_model")
    began = time.perf_counter()
    (r,), _ = CpuReferenceBackend().search(connect4.parse_moves("44"), params, _SlowModel(0.4), [None])
    elapsed_ms = (time.perf_counter() - began) * 1e3
    assert r.deadline_reached and r.extras["waves"] >= 1 and r.model_simulations == r.simulations
    assert elapsed_ms < 1900.0, elapsed_ms


# -- end to end ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    cfg = loopback_config(search={"backend": "cpu", "max_deadline_ms": 1500, "max_session_bytes": 1 << 20})
    service = search_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.search.address)
    yield search_pb2_grpc.SearchServiceStub(ch), service
    ch.close()
    service.stop()


def test_a_search_bounded_only_by_its_grpc_deadline_answers_ok_in_time(served):
    stub, _ = served
    for timeout_s in (1.0, 2.0):
        began = time.monotonic()
        r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="44", simulations=HUGE), timeout=timeout_s)
        assert time.monotonic() - began < timeout_s
        assert r.deadline_reached and 0 < r.simulations < HUGE and r.visit_counts[r.action] == max(r.visit_counts)


def test_a_value_model_search_with_slow_waves_answers_ok_by_its_grpc_deadline(served):
    """Each model call takes 0.4 s: root valued at ~0.4 s, a wave ends at ~0.8 s;
    the next would end at ~1.2 s, past the 1 s gRPC deadline, so the search
    answers OK at ~0.8 s (it used to start that wave: DEADLINE_EXCEEDED)."""
    stub, service = served
    evaluator, service.servicer.evaluator = service.servicer.evaluator, _SlowModel(0.4)
    try:
        began = time.monotonic()
        r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="44", simulations=HUGE,
                                                 evaluator=search_pb2.EVALUATOR_VALUE_MODEL), timeout=1.0)
        assert time.monotonic() - began < 1.0
        assert r.deadline_reached and r.model_simulations == r.simulations > 0
        assert r.evaluator == search_pb2.EVALUATOR_VALUE_MODEL
    finally:
        service.servicer.evaluator = evaluator


def test_a_search_without_a_deadline_stops_at_max_deadline_ms(served):
    stub, _ = served
    r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=HUGE), timeout=120)
    assert r.deadline_reached and 0 < r.simulations < HUGE
    assert r.latency.total_ms < 60_000  # stopped near its 1.5 s, not at the 120 s gRPC deadline


def test_session_trees_are_kept_within_max_session_bytes(served):
    stub, service = served
    sessions = service.servicer.sessions
    for game in range(6):
        r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="4", simulations=2000, seed=1,
                                                 session_id=f"game-{game}"), timeout=60)
        assert r.simulations > 0  # (the pool is sized for 2000 nodes however many ran by the 1.5 s limit)
        assert 0 < sessions.nbytes <= 1 << 20
    assert len(sessions) < 6  # the oldest went to stay within the bound
    # The most recent game is still kept and reused.
    r = stub.Search(search_pb2.SearchRequest(game="connect4", moves="44", simulations=100, session_id="game-5"),
                    timeout=60)
    assert r.tree_reused


# -- the store ------------------------------------------------------------------------------------

class _Tree:
    def __init__(self, nbytes: int):
        self.pool = np.zeros(nbytes, np.uint8)


def test_session_store_bounds_bytes_least_recently_used_first():
    store = SessionStore(max_sessions=100, ttl_ms=60_000, max_bytes=2500)
    assert tree_bytes(_Tree(1000)) == 1000
    for name in "abc":
        assert store.put(("owner", name), "4", _Tree(1000))
    assert len(store) == 2 and store.nbytes == 2000  # "a" went for "c"
    assert store.take(("owner", "a"), "4", lambda t, a: t) == (None, True)  # a session of its own, anew
    assert store.take(("owner", "b"), "4", lambda t, a: t)[0] is not None and store.nbytes == 1000
    assert not store.put(("owner", "big"), "4", _Tree(3000))  # larger than the bound alone: not kept
    assert store.nbytes == 1000 and store.take(("owner", "big"), "4", lambda t, a: t) == (None, True)


def test_session_store_keeps_a_session_whose_search_gave_no_tree_back():
    # A game folder's search on the CUDA backend answers without a tree: the session stays, treeless.
    store = SessionStore(max_sessions=100, ttl_ms=60_000, max_bytes=2500)
    assert tree_bytes(None) == 0
    assert store.take(("owner", "s"), "", lambda t, a: t) == (None, True)
    assert store.put(("owner", "s"), "d3", None) and store.nbytes == 0 and len(store) == 1
    assert store.take(("owner", "s"), "d3c5", lambda t, a: t) == (None, True)

"""SearchBatch and the wave loop over real gRPC on loopback (CPU reference):
K positions answered as K searches alone, sessions across batch calls,
concurrent callers sharing one batch of trees, and each bad input's status."""
from __future__ import annotations

import threading

import grpc
import pytest
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from search_service import server as search_server
from tandem.server import channel

LIMIT = 8


@pytest.fixture(scope="module")
def stack():
    cfg = loopback_config(search={"backend": "cpu", "max_batch_searches": LIMIT, "max_trees": 12,
                                  "max_deadline_ms": 5000})
    search = search_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.search.address)
    yield search_pb2_grpc.SearchServiceStub(ch), search
    ch.close()
    search.stop()


def req(**kw):
    kw.setdefault("game", "connect4")
    return search_pb2.SearchRequest(**kw)


def batch(*searches):
    return search_pb2.SearchBatchRequest(searches=list(searches))


def key(r):
    return (r.action, list(r.visit_counts), [round(q, 6) for q in r.q_values], list(r.principal_variation),
            r.simulations)


def test_a_batch_call_answers_each_position_as_a_search_alone(stack):
    stub, _ = stack
    searches = [req(moves=m, simulations=60 + 20 * i, seed=i + 1) for i, m in enumerate(["4453", "", "1234567", "33"])]
    together = stub.SearchBatch(batch(*searches), timeout=60).results
    assert len(together) == len(searches)
    for s, r in zip(searches, together):
        assert key(r) == key(stub.Search(s, timeout=60)) and r.simulations == s.simulations
        assert r.backend == "cpu_reference"


def test_sessions_continue_across_batch_calls(stack):
    stub, _ = stack
    first = stub.SearchBatch(batch(req(moves="4", simulations=200, session_id="npc-a"),
                                   req(moves="3", simulations=200, session_id="npc-b")), timeout=60).results
    assert not any(r.tree_reused for r in first)
    again = stub.SearchBatch(batch(req(moves="44", simulations=50, session_id="npc-a"),
                                   req(moves="33", simulations=50, session_id="npc-b")), timeout=60).results
    assert all(r.tree_reused for r in again)


def test_concurrent_callers_share_the_batch_and_all_answer_by_their_deadlines(stack):
    stub, search = stack
    out, errors = [], []

    def engine(i):
        try:
            r = stub.SearchBatch(batch(*[req(moves="4453", deadline_ms=150) for _ in range(2)]), timeout=30)
            out.extend(r.results)
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(out) == 10
    assert all(r.simulations > 0 and r.deadline_reached for r in out)
    assert search.servicer.loop.in_flight() == 0


@pytest.mark.parametrize("request_, code, words", [
    (batch(), grpc.StatusCode.INVALID_ARGUMENT, "searches: empty"),
    (batch(*[req(moves="4", simulations=10)] * (LIMIT + 1)), grpc.StatusCode.INVALID_ARGUMENT, "exceed the limit of 8"),
    (batch(req(moves="4", simulations=10), req(game="chess", moves="4", simulations=10)),
     grpc.StatusCode.INVALID_ARGUMENT, "one game per call"),
    (batch(req(moves="4", simulations=10, session_id="s"), req(moves="3", simulations=10, session_id="s")),
     grpc.StatusCode.INVALID_ARGUMENT, "searches[1].session_id"),
    (batch(req(moves="4", simulations=10), req(moves="48", simulations=10)),
     grpc.StatusCode.INVALID_ARGUMENT, "searches[1].moves"),
    (batch(req(moves="4", simulations=10), req(moves="4")),
     grpc.StatusCode.INVALID_ARGUMENT, "searches[1].simulations, deadline_ms"),
    (batch(req(moves="4", deadline_ms=-1)), grpc.StatusCode.INVALID_ARGUMENT, "searches[0].deadline_ms"),
    (batch(req(moves="4", deadline_ms=5001)), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the limit of 5000"),
    (batch(req(game="chess", moves="4", simulations=10)), grpc.StatusCode.NOT_FOUND, "searches[0].game"),
])
def test_bad_batch_calls_get_a_clear_status_and_the_server_keeps_serving(stack, request_, code, words):
    stub, _ = stack
    with pytest.raises(grpc.RpcError) as err:
        stub.SearchBatch(request_, timeout=30)
    assert err.value.code() == code and words in err.value.details()
    assert stub.Search(req(moves="4", simulations=20), timeout=30).simulations == 20


def test_a_flood_beyond_capacity_is_refused_at_once_and_nothing_accepted_is_lost(stack):
    """max_trees is 12: a call of 8 long searches is in flight, a second of 8
    does not fit and is refused at once; the first answers in full (its
    budget, or search.max_deadline_ms on a slow host)."""
    stub, _ = stack
    first = stub.SearchBatch.future(batch(*[req(moves="4", simulations=4000, seed=i + 1) for i in range(LIMIT)]),
                                    timeout=60)
    while stack[1].servicer.loop.in_flight() < LIMIT and not first.done():
        threading.Event().wait(0.005)
    with pytest.raises(grpc.RpcError) as err:
        stub.SearchBatch(batch(*[req(moves="3", simulations=100)] * LIMIT), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "search.max_trees" in err.value.details()
    answers = first.result().results
    assert len(answers) == LIMIT and all(r.simulations == 4000 or r.deadline_reached for r in answers)


def test_a_call_arriving_with_its_deadline_spent_is_refused_before_it_is_read(stack, monkeypatch):
    """While searches are in flight, a call whose gRPC deadline leaves no more
    than the reply's margin (search_service/budget.py; made 5 s here, so a
    call with 3 s left has no time for a search on any host) is refused at
    once, counted as ``spent``, before its request is read (its unknown game
    is never looked at); the search in flight answers in full."""
    from search_service import budget
    from search_service.wave_loop import REFUSED

    stub, search = stack
    first = stub.Search.future(req(moves="4", simulations=4000, seed=3), timeout=60)
    while search.servicer.loop.in_flight() < 1 and not first.done():
        threading.Event().wait(0.005)
    monkeypatch.setattr(budget, "REPLY_MARGIN_MIN_MS", 5000.0)
    monkeypatch.setattr(budget, "REPLY_MARGIN_MAX_MS", 5000.0)
    spent = REFUSED.labels("spent")
    before = spent._value.get()
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(req(game="no-such-game", moves="4"), timeout=3)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "left of its gRPC deadline" in err.value.details() and "searches in flight (1)" in err.value.details()
    assert spent._value.get() == before + 1
    with pytest.raises(grpc.RpcError) as err:  # a batch call counts each of its searches
        stub.SearchBatch(batch(*[req(moves="3")] * 3), timeout=3)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and spent._value.get() == before + 4
    monkeypatch.undo()
    assert first.result().simulations == 4000 or first.result().deadline_reached


def test_a_call_with_its_deadline_spent_is_still_read_when_nothing_is_in_flight(stack, monkeypatch):
    from search_service import budget

    stub, search = stack
    while search.servicer.loop.in_flight():
        threading.Event().wait(0.01)
    monkeypatch.setattr(budget, "REPLY_MARGIN_MIN_MS", 5000.0)
    monkeypatch.setattr(budget, "REPLY_MARGIN_MAX_MS", 5000.0)
    with pytest.raises(grpc.RpcError) as err:
        stub.Search(req(game="no-such-game", moves="4"), timeout=3)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # read: its game named as unknown

"""The value model's leaf path in the search service: the evaluation cache and
the coalescing of concurrent searches' leaves into one call."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from reward_service import server as reward_server
from search_service import server as search_server
from search_service.coalescing import CoalescingEvaluator
from search_service.games import connect4 as c4
from search_service.leaf_cache import ENTRY_BYTES, CachedEvaluator, EvaluationCache
from search_service.mcts.backend import EvaluationFailed
from tandem.server import channel
from tandem.deadline import Deadline


def observations(*moves: str) -> np.ndarray:
    return c4.observation(c4.stack([c4.parse_moves(m) for m in moves]))


class Model:
    """A deterministic inner evaluator: value = tanh of the stone count / 42,
    priors one-hot on the number of stones mod 7; records every call; can be held."""

    def __init__(self, fail: bool = False):
        self.calls: list[int] = []  # rows per call
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail = fail

    def __call__(self, obs, deadline=None):
        self.entered.set()
        assert self.gate.wait(10)
        self.calls.append(len(obs))
        if self.fail:
            raise EvaluationFailed("reward service: UNAVAILABLE")
        stones = obs.reshape(len(obs), -1).sum(axis=1)
        priors = np.eye(7, dtype=np.float32)[stones % 7]
        return np.tanh(stones / 42).astype(np.float32), priors


def expected(obs):
    stones = obs.reshape(len(obs), -1).sum(axis=1)
    return np.tanh(stones / 42).astype(np.float32), np.eye(7, dtype=np.float32)[stones % 7]


# -- the cache ------------------------------------------------------------------------


def test_the_cache_answers_repeated_positions_and_asks_only_for_the_rest():
    model = Model()
    ev = CachedEvaluator(model, EvaluationCache(1 << 20))
    first = observations("4", "44", "445")
    v, p = ev(first)
    np.testing.assert_array_equal(v, expected(first)[0])
    mixed = observations("44", "4453", "4")  # two seen, one new
    v, p = ev(mixed)
    assert model.calls == [3, 1]
    np.testing.assert_array_equal(v, expected(mixed)[0])
    np.testing.assert_array_equal(p, expected(mixed)[1])
    v, _ = ev(observations("4", "44"))
    assert model.calls == [3, 1]  # all hits: no call
    assert ev.cache.hits == 4 and ev.cache.misses == 4 and ev.cache.hit_rate == 0.5


def test_the_cache_keeps_its_byte_budget_least_recently_used_out():
    cache = EvaluationCache(2 * ENTRY_BYTES)  # room for two positions
    obs = observations("1", "2", "3")
    cache.store(obs[:2], np.array([0.1, 0.2], np.float32), None)
    cache.lookup(obs[:1])  # "1" used again: "2" is now the least recent
    cache.store(obs[2:], np.array([0.3], np.float32), None)
    hit, values, priors = cache.lookup(obs)
    assert hit.tolist() == [True, False, True] and len(cache) == 2 and priors is None
    assert values[0] == np.float32(0.1) and values[2] == np.float32(0.3)


def test_a_zero_budget_keeps_nothing():
    ev = CachedEvaluator(Model(), EvaluationCache(0))
    ev(observations("4"))
    ev(observations("4"))
    assert ev.inner.calls == [1, 1] and len(ev.cache) == 0


# -- coalescing --------------------------------------------------------------------------


def _in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_searches_waiting_during_a_call_share_the_next_one():
    model = Model()
    ev = CoalescingEvaluator(model)
    try:
        model.gate.clear()
        first, out0 = _in_thread(ev, observations("4"))
        assert model.entered.wait(5)  # the first call is in flight, held
        waiting = [_in_thread(ev, observations(m, m + "1")) for m in ("2", "3", "5")]
        deadline = time.monotonic() + 5
        while sum(len(r.obs) for r in ev._queue) < 6 and time.monotonic() < deadline:
            time.sleep(0.001)
        model.gate.set()
        for t, _ in [(first, out0), *waiting]:
            t.join(5)
        assert model.calls == [1, 6]  # the three waiting searches went in one call
        for m, (_, out) in zip(("2", "3", "5"), waiting):
            obs = observations(m, m + "1")
            np.testing.assert_array_equal(out["value"][0], expected(obs)[0])
            np.testing.assert_array_equal(out["value"][1], expected(obs)[1])
    finally:
        ev.close()


def test_a_caller_past_its_deadline_gives_up_and_the_others_get_their_answers():
    model = Model()
    ev = CoalescingEvaluator(model)
    try:
        model.gate.clear()
        first, out0 = _in_thread(ev, observations("4"))
        assert model.entered.wait(5)
        with pytest.raises(EvaluationFailed, match="DEADLINE_EXCEEDED"):
            ev(observations("3"), Deadline.after_s(0.01))
        model.gate.set()
        first.join(5)
        np.testing.assert_array_equal(out0["value"][0], expected(observations("4"))[0])
        v, _ = ev(observations("2"))  # the dispatcher still serves
        np.testing.assert_array_equal(v, expected(observations("2"))[0])
        assert model.calls == [1, 1]  # the abandoned request was dropped, never sent
    finally:
        ev.close()


def test_a_failed_call_fails_every_search_in_it_and_closing_fails_the_rest():
    ev = CoalescingEvaluator(Model(fail=True))
    with pytest.raises(EvaluationFailed, match="UNAVAILABLE"):
        ev(observations("4"))
    ev.close()
    with pytest.raises(EvaluationFailed, match="closed"):
        ev(observations("4"))


# -- through the real services ----------------------------------------------------------


def test_concurrent_value_model_searches_share_calls_and_the_cache():
    cfg = loopback_config(search={"backend": "cpu", "value_model_parallel_sims": 8})
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        with channel(cfg.search.address) as ch:
            stub = search_pb2_grpc.SearchServiceStub(ch)
            req = search_pb2.SearchRequest(game="connect4", moves="4453", simulations=64,
                                           evaluator=search_pb2.EVALUATOR_VALUE_MODEL, seed=1)
            calls = [stub.Search.future(req, timeout=60) for _ in range(6)]
            replies = [c.result() for c in calls]
            cached = search.servicer.evaluator
            made, hits = cached.inner.calls, cached.cache.hits
            again = stub.Search(req, timeout=60)  # the same search once more, alone
        assert all(r.model_simulations == r.simulations == 64 for r in replies + [again])
        waves = 6 * (1 + 64 // 8)  # each search: the fresh root, then its waves
        # However the six overlapped, each wave was coalesced with another's or answered from the cache.
        assert made < waves
        # The repeat meets only leaves already valued: all from the cache, no model call.
        assert cached.inner.calls == made and cached.cache.hits > hits
    finally:
        search.stop()
        reward.stop()


def test_a_far_deadline_waits_like_none():
    """A search with no gRPC deadline gets a deadline far away; the wait must not overflow."""
    ev = CoalescingEvaluator(Model())
    try:
        v, _ = ev(observations("4"), Deadline.after_s(1e12))
        np.testing.assert_array_equal(v, expected(observations("4"))[0])
    finally:
        ev.close()

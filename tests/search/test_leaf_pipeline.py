"""The value model's leaf path in the search service: the evaluation cache,
and concurrent searches' leaves in one call per wave of their batch."""
from __future__ import annotations

import threading

import numpy as np
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from reward_service import server as reward_server
from search_service import server as search_server
from search_service.games import connect4 as c4
from search_service.leaf_cache import ENTRY_BYTES, CachedEvaluator, EvaluationCache
from search_service.mcts.backend import EvaluationFailed
from tandem.server import channel


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
        # However the six overlapped, they shared waves of one batch (one call each) or the cache.
        assert made < waves
        # The repeat meets only leaves already valued: all from the cache, no model call.
        assert cached.inner.calls == made and cached.cache.hits > hits
    finally:
        search.stop()
        reward.stop()

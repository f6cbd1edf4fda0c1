"""The value model's leaf path in the search service: the evaluation cache,
and concurrent searches' leaves in one call per wave of their batch."""
from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
from conftest import loopback_config
from tandem.v1 import search_pb2, search_pb2_grpc

from reward_service import server as reward_server
from search_service import server as search_server
from search_service.games import connect4 as c4
from search_service.evaluators import EvaluatorUnavailable, HandoffEvaluator
from search_service.leaf_cache import ENTRY_BYTES, CachedEvaluator, EvaluationCache
from search_service.mcts.backend import EvaluationFailed
from tandem.deadline import Deadline
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


# -- the hand-off's one call at a time ---------------------------------------------------


def _grpc_handoff(answer) -> HandoffEvaluator:
    """A HandoffEvaluator on gRPC whose calls ``answer`` takes (a stand-in for a
    reward service that answers so; the channel is never dialled)."""
    handoff = HandoffEvaluator(grpc.insecure_channel("127.0.0.1:1"), "connect4_value", "grpc")
    handoff.grpc = answer
    return handoff


def test_a_wave_waits_for_another_groups_call_only_until_its_deadline():
    handoff = _grpc_handoff(Model())
    with handoff._calls:  # another group's wave holds the channel
        with pytest.raises(EvaluatorUnavailable, match="waiting for another wave's model call"):
            handoff(observations("4"), Deadline.after_ms(1.0))
    values, _ = handoff(observations("4"), Deadline.after_ms(10_000))  # free again: answered
    np.testing.assert_array_equal(values, expected(observations("4"))[0])
    assert handoff.calls == 1


def test_a_malformed_answer_fails_the_wave_as_unavailable_never_the_batch():
    def broken(obs, deadline=None):
        raise KeyError("value")  # an answer without the model's value output

    handoff = _grpc_handoff(broken)
    with pytest.raises(EvaluatorUnavailable, match="malformed answer: KeyError"):
        handoff(observations("4"))
    handoff.grpc = Model()
    assert handoff(observations("4"))[0].shape == (1,)  # the next call goes through: the lock was given back


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

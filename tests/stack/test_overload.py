"""Overload shedding (tandem/overload.py, issue 39 part 2): a server whose
admitted calls have queued without a break for an interval refuses those
that waited past ``server.queue_wait_target_ms``, RESOURCE_EXHAUSTED before
any work, instead of serving them late; a burst shorter than the interval is
served; the episode ends when the queue empties.

The rule is tested on its own clock; the servers are real, on loopback, with a
target of 1 µs (every call's hand-off to a worker thread takes longer) and an
interval of 0 (a queue stands as soon as a call waits in it), so every call
is shed, on any host.
"""
from __future__ import annotations

import grpc
import pytest
from conftest import loopback_config, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import reward_pb2, reward_pb2_grpc, search_pb2, search_pb2_grpc

from reward_service import server as reward_server
from search_service import server as search_server
from tandem.config import ConfigError, parse_config
from tandem import overload
from tandem.overload import INTERVAL_S, QueueWait

C = grpc.StatusCode
TARGET_MS = 5.0
LATE, SHORT = 0.020, 0.001  # waits (s) past and within the target


def _queue(*arrivals: float) -> QueueWait:
    rule = QueueWait(TARGET_MS)
    for t in arrivals:
        rule.arrived(t)
    return rule


def test_a_burst_shorter_than_the_interval_is_served():
    rule = _queue(*[0.001 * i for i in range(10)])  # ten calls within 10 ms, each started late
    assert all(rule.started(LATE, now=0.02 + 0.001 * i) for i in range(10))
    assert rule.shed == 0 and rule.queued == 0


def test_a_call_after_an_idle_spell_starts_an_episode_of_its_own():
    rule = _queue(0.0)
    assert rule.started(SHORT, now=0.001)
    rule.arrived(5.0)  # seconds later: the queue was empty meanwhile
    assert rule.started(LATE, now=5.0 + LATE)
    assert rule.shed == 0


def test_a_standing_queue_sheds_the_calls_that_waited_past_the_target_until_it_empties():
    rule = _queue(0.0, 0.05, 0.09)
    assert rule.started(SHORT, now=0.05)  # the queue has not emptied since 0.0
    assert not rule.started(LATE, now=INTERVAL_S + 0.01)  # standing, waited past the target: refused
    assert rule.started(SHORT, now=INTERVAL_S + 0.012)  # standing, but it started within the target: served
    assert rule.queued == 0
    rule.arrived(INTERVAL_S + 0.02)  # the queue emptied: a new episode
    assert rule.started(LATE, now=INTERVAL_S + 0.02 + LATE)
    assert rule.shed == 1


def test_a_call_gone_before_its_thread_started_leaves_the_queue():
    rule = _queue(0.0)
    rule.gone()
    assert rule.queued == 0
    rule.arrived(1.0)  # so a later arrival starts a new episode
    assert rule.started(LATE, now=1.0 + LATE)


def test_a_target_of_zero_never_sheds():
    rule = QueueWait(0.0)
    rule.arrived(0.0)
    assert rule.started(10.0, now=10.0)
    assert rule.shed == 0


def test_the_refusal_names_the_wait_the_target_and_the_key():
    message = QueueWait(TARGET_MS).refusal("/tandem.v1.SearchService/Search", 0.0123)
    assert "12.3 ms" in message and "100 ms" in message and "server.queue_wait_target_ms: 5 ms" in message
    assert message.startswith("/tandem.v1.SearchService/Search: the server is overloaded")


def test_the_key_takes_zero_and_refuses_a_negative_naming_itself():
    assert parse_config({"search": {"server": {"queue_wait_target_ms": 0}}}).search.server.queue_wait_target_ms == 0
    with pytest.raises(ConfigError) as info:
        parse_config({"reward": {"server": {"queue_wait_target_ms": -1}}})
    assert "reward.server.queue_wait_target_ms: must be >= 0" in str(info.value)


@pytest.fixture
def standing(monkeypatch):
    """Servers built meanwhile find their queue standing whenever a call waits in it."""
    monkeypatch.setattr(overload, "INTERVAL_S", 0.0)


def test_a_search_server_whose_queue_stands_refuses_at_once_and_keeps_serving_health(standing):
    cfg = loopback_config(search={"backend": "cpu", "server": {"queue_wait_target_ms": 0.001}})
    service = search_server.start(cfg, follow_scheduler=False)
    ch = grpc.insecure_channel(cfg.search.address)
    try:
        stub = search_pb2_grpc.SearchServiceStub(ch)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                stub.Search(search_pb2.SearchRequest(game="connect4", moves="44", simulations=50), timeout=10)
            assert info.value.code() == C.RESOURCE_EXHAUSTED
            assert "overloaded" in info.value.details() and "server.queue_wait_target_ms" in info.value.details()
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # health calls are never shed
    finally:
        ch.close()
        service.stop()


def test_a_search_server_without_shedding_serves_the_same_calls(standing):
    cfg = loopback_config(search={"backend": "cpu", "server": {"queue_wait_target_ms": 0}})
    service = search_server.start(cfg, follow_scheduler=False)
    ch = grpc.insecure_channel(cfg.search.address)
    try:
        reply = search_pb2_grpc.SearchServiceStub(ch).Search(
            search_pb2.SearchRequest(game="connect4", moves="44", simulations=50), timeout=30)
        assert reply.simulations == 50
    finally:
        ch.close()
        service.stop()


def test_a_reward_server_whose_queue_stands_refuses_its_calls_at_once(standing):
    cfg = loopback_config(reward={"server": {"queue_wait_target_ms": 0.001}})
    service = reward_server.start(cfg, follow_scheduler=False)
    ch = grpc.insecure_channel(cfg.reward.address)
    try:
        with pytest.raises(grpc.RpcError) as info:
            reward_pb2_grpc.RewardServiceStub(ch).ListModels(reward_pb2.ListModelsRequest(), timeout=10)
        assert info.value.code() == C.RESOURCE_EXHAUSTED and "overloaded" in info.value.details()
    finally:
        ch.close()
        service.stop()


def test_every_call_leaves_the_queue_whatever_its_end():
    """Served, refused for its connection or for the limit, cancelled at once by
    its caller: afterwards no call is counted as queued (a call counted for ever
    would keep the queue standing, and the server shedding, for good)."""
    cfg = loopback_config(search={"backend": "cpu", "server": {
        "max_workers": 4, "max_concurrent_rpcs": 4, "max_rpcs_per_connection": 2}})
    service = search_server.start(cfg, follow_scheduler=False)
    ch = grpc.insecure_channel(cfg.search.address)
    try:
        stub = search_pb2_grpc.SearchServiceStub(ch)
        request = search_pb2.SearchRequest(game="connect4", moves="44", simulations=500)
        calls = [stub.Search.future(request, timeout=10) for _ in range(8)]
        codes = {c.code() for c in calls}
        assert C.RESOURCE_EXHAUSTED in codes and C.OK in codes, codes
        for _ in range(50):
            stub.Search.future(request, timeout=10).cancel()
        admission = service.running.admission
        assert wait_for(lambda: admission.in_flight == 0, 10), admission.in_flight
        assert admission.queue_wait.queued == 0
    finally:
        ch.close()
        service.stop()

"""How a value-model search's leaves reach the reward service (search.handoff):
the leaf channel on this host, gRPC otherwise or when told, the hand-off
reported in each answer, and a reward service that dies mid-search: the search
keeps its tree, goes on with rollouts and says why; a new reward service is
attached again."""
from __future__ import annotations

import contextlib
import socket
import threading

import numpy as np
import pytest
from conftest import loopback_config, wait_for
from tandem.v1 import reward_pb2_grpc, search_pb2, search_pb2_grpc

from reward_service import server as reward_server
from search_service import evaluators
from search_service import server as search_server
from search_service.evaluators import DeviceWaves, EvaluatorUnavailable, HandoffEvaluator, LeafChannelEvaluator
from tandem.leaf_channel import ATTACH, MAX_MESSAGE_BYTES, LeafChannel
from tandem.server import channel
from tandem.deadline import Deadline


def value_search(moves: str = "4453", **fields) -> search_pb2.SearchRequest:
    return search_pb2.SearchRequest(game="connect4", moves=moves, seed=1,
                                    **({"simulations": 64, "evaluator": search_pb2.EVALUATOR_VALUE_MODEL} | fields))


@pytest.fixture
def services(request):
    """A reward and a search service (CPU) of ``search.handoff`` = the test's parameter (default auto)."""
    mode = getattr(request, "param", "auto")
    cfg = loopback_config(search={"backend": "cpu", "value_model_parallel_sims": 8, "handoff": mode,
                                  "evaluation_cache_bytes": 0})
    reward = reward_server.start(cfg, follow_scheduler=False)
    with serving(cfg, reward, search_server.start(cfg, follow_scheduler=False)) as box:
        yield box


@contextlib.contextmanager
def serving(cfg, reward, search):
    """``cfg``, both services and a search stub (``box["reward"]`` may be
    replaced by a test); the search service, then the reward service, stopped
    at the end."""
    ch = channel(cfg.search.address)
    box = {"cfg": cfg, "reward": reward, "search": search, "stub": search_pb2_grpc.SearchServiceStub(ch)}
    try:
        yield box
    finally:
        ch.close()
        search.stop()
        box["reward"].stop()


def test_on_one_host_the_leaves_go_by_the_leaf_channel(services):
    handoff = services["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    reply = services["stub"].Search(value_search(), timeout=60)
    assert reply.handoff == "leaf_channel" and reply.model_simulations == reply.simulations == 64
    assert handoff._leaf.totals.calls > 0 and handoff._leaf.channel.kind == "memfd"  # the CPU build's regions
    rollout = services["stub"].Search(value_search(evaluator=search_pb2.EVALUATOR_ROLLOUT), timeout=60)
    assert rollout.handoff == ""  # no leaves handed off


def test_system_regions_lend_no_device_waves(services):
    """Device waves need CUDA regions: over the CPU build's system regions
    none is attached or lent, and a search goes the host way."""
    handoff = services["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    assert handoff.wait_device_channels(0.3) == 0
    with handoff.lend(None) as waves:
        assert waves is None
    reply = services["stub"].Search(value_search(), timeout=60)
    assert reply.handoff == "leaf_channel" and reply.model_simulations == reply.simulations


@pytest.mark.parametrize("services", ["grpc"], indirect=True)
def test_told_grpc_it_never_attaches(services):
    handoff = services["search"].servicer.handoff
    assert not handoff.wait_attached(0.5)
    reply = services["stub"].Search(value_search(), timeout=60)
    assert reply.handoff == "grpc" and reply.model_simulations == 64
    assert handoff.why_grpc == "search.handoff: grpc"


def test_a_reward_service_without_a_leaf_channel_is_reached_by_grpc():
    cfg = loopback_config(search={"backend": "cpu", "value_model_parallel_sims": 8},
                          reward={"leaf_channel": {"enabled": False}})
    reward = reward_server.start(cfg, follow_scheduler=False)
    search = search_server.start(cfg, follow_scheduler=False)
    try:
        with channel(cfg.search.address) as ch:
            handoff = search.servicer.handoff
            assert not handoff.wait_attached(1.0)
            reply = search_pb2_grpc.SearchServiceStub(ch).Search(value_search(), timeout=60)
        assert reply.handoff == "grpc" and reply.model_simulations == 64
        assert handoff.why_grpc == "the reward service offers no leaf channel"
    finally:
        search.stop()
        reward.stop()


def test_a_reward_service_killed_mid_search_leaves_the_tree_and_a_reason_and_a_new_one_is_attached(services):
    handoff = services["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    leaf = handoff._leaf
    r = stopped_mid_search(services, leaf)  # its leaf channel closes with it
    assert 0 < r.model_simulations < r.simulations  # the tree built so far was kept, rollouts went on in it
    assert "leaf channel" in r.evaluation_failure and r.handoff == "leaf_channel"
    assert r.deadline_reached
    # A reward service again (a restart: the same address, a new socket): attached again.
    services["reward"] = reward_server.start(services["cfg"], follow_scheduler=False)
    assert handoff.wait_attached(10.0) and handoff._leaf is not leaf
    assert handoff.why_grpc == ""  # attached again: no reason for gRPC left over
    again = services["stub"].Search(value_search(), timeout=60)
    assert again.handoff == "leaf_channel" and again.model_simulations == 64 and not again.evaluation_failure


def stopped_mid_search(box, evaluator) -> search_pb2.SearchResponse:
    """The answer of a long value-model search during which the reward
    service was stopped, once ``evaluator`` had valued a few of its waves."""
    answer = {}
    long_search = value_search(moves="", simulations=10_000_000, deadline_ms=4000)
    thread = threading.Thread(target=lambda: answer.setdefault("r", box["stub"].Search(long_search, timeout=60)))
    calls = evaluator.totals.calls
    thread.start()
    assert wait_for(lambda: evaluator.totals.calls >= calls + 3, 30)  # a few waves valued by the model
    box["reward"].stop()
    thread.join(60)
    return answer["r"]


@pytest.fixture
def reward_only():
    cfg = loopback_config()
    reward = reward_server.start(cfg, follow_scheduler=False)
    ch = channel(cfg.reward.address, cfg)
    yield reward, ch
    ch.close()
    reward.stop()



def test_a_closed_handoff_drops_the_attach_under_way_and_never_attaches_again(reward_only):
    reward, ch = reward_only
    handoff = HandoffEvaluator(ch, "connect4_value")
    assert handoff._channel() is None  # an attach started in the background
    handoff.close()  # before it ends (a registration and a connect take far longer than this)
    assert wait_for(lambda: not handoff._attaching)
    assert handoff._leaf is None and not handoff.wait_attached(1.0)
    # Nothing left on the reward service: no connection, no region of the search's.
    assert wait_for(lambda: not reward.servicer.leaf_channel._connections)
    assert wait_for(lambda: reward.servicer.regions.stats()["regions"] == 0)


def test_a_leaf_channel_that_never_answers_fails_the_wave_by_timeout_s_without_a_deadline(reward_only, tmp_path):
    """As over gRPC, a wave with no deadline waits ``timeout_s``, not forever."""
    _, ch = reward_only
    path = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    accepted = []

    def answer_the_attach_only():
        conn, _ = listener.accept()
        accepted.append(conn)
        conn.recv(MAX_MESSAGE_BYTES)
        conn.send(ATTACH + b"{}")

    threading.Thread(target=answer_the_attach_only, daemon=True).start()
    lc = LeafChannel(reward_pb2_grpc.RewardServiceStub(ch), path, "connect4_value", 4)
    evaluator = LeafChannelEvaluator(lc, timeout_s=0.3)
    outcome = {}

    def call():
        try:
            evaluator(np.zeros((1, 2, 6, 7), np.uint8))
        except EvaluatorUnavailable as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=call, daemon=True)
    try:
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the wave waited past timeout_s"
        assert "DEADLINE_EXCEEDED" in outcome["error"]
    finally:
        for conn in accepted:
            conn.close()  # the wave's recv, if still waiting, ends with the connection
        thread.join(10)
        lc.close()
        listener.close()


def test_an_attach_failing_unexpectedly_is_retried(reward_only, monkeypatch):
    """An error the attach does not expect (as CuPy's out of memory for the input
    region) must not leave it marked under way for good: gRPC meanwhile, then attached."""
    _, ch = reward_only
    failures = []

    offered = LeafChannel.offered

    def out_of_memory_once(*args, **kwargs):
        if not failures:
            failures.append(1)
            raise RuntimeError("out of memory allocating the input region")
        return offered(*args, **kwargs)

    monkeypatch.setattr(evaluators.LeafChannel, "offered", out_of_memory_once)
    handoff = HandoffEvaluator(ch, "connect4_value", retry_s=0.1)
    try:
        assert handoff._channel() is None  # the first attempt, in the background...
        assert wait_for(lambda: failures and not handoff._attaching)
        assert handoff._leaf is None and "out of memory" in handoff.why_grpc  # ...failed
        assert handoff.wait_attached(10.0)  # a later one attached
        values, priors = handoff(np.zeros((3, 2, 6, 7), np.uint8), Deadline.after_s(10))
        assert handoff.handoff == "leaf_channel" and values.shape == (3,) and priors.shape == (3, 7)
    finally:
        handoff.close()


def test_a_model_whose_signature_does_not_fit_goes_the_host_way():
    """DeviceWaves carries the selection kernel's uint8 [2, 6, 7] leaves in, a
    value of one float per row and logits of one per move out; a channel of
    another signature is not lent (the host way's checks then refuse the
    answer: EvaluationFailed, and the search goes on)."""
    class Channel:
        device_inputs = object()
        input_dtype, input_row = np.dtype(np.uint8), (2, 6, 7)
        output_rows = [("value", (2,)), ("policy_logits", (7,))]

    assert not DeviceWaves.fits(Channel())
    Channel.output_rows = [("value", (1,)), ("policy_logits", (6,))]
    assert not DeviceWaves.fits(Channel())
    Channel.output_rows = [("value", (1,))]
    assert DeviceWaves.fits(Channel())
    Channel.input_dtype = np.dtype(np.float32)
    assert not DeviceWaves.fits(Channel())
    Channel.input_dtype, Channel.input_row = np.dtype(np.uint8), (84,)
    assert not DeviceWaves.fits(Channel())
    Channel.input_row, Channel.device_inputs = (2, 6, 7), None
    assert not DeviceWaves.fits(Channel())


class _DeviceChannel:
    """What lending touches of an attached leaf channel with CUDA regions."""

    max_rows, device_inputs, kind = 64, object(), "cuda"

    def __init__(self):
        self.closed, self.closes = False, 0

    def close(self):
        self.closed, self.closes = True, self.closes + 1


def _pool(n: int) -> tuple[HandoffEvaluator, list]:
    """A HandoffEvaluator whose device pool holds ``n`` fake channels (no top-up: none attached)."""
    handoff = HandoffEvaluator(channel("127.0.0.1:1"), "connect4_value", "leaf_channel", device_channels=n)
    evs = [LeafChannelEvaluator(_DeviceChannel(), 1.0) for _ in range(n)]
    handoff._device_free, handoff._device_count = list(evs), n
    return handoff, evs


def test_lend_gives_each_search_its_own_channel_and_takes_it_back():
    handoff, evs = _pool(2)
    with handoff.lend(None) as a, handoff.lend(None) as b:
        assert a is not None and b is not None and a._ev is not b._ev
        with handoff.lend(None) as c:
            assert c is None  # both lent: this search goes the host way
    assert sorted(map(id, handoff._device_free)) == sorted(map(id, evs)) and handoff._device_count == 2
    handoff.close()
    assert all(ev.channel.closes == 1 for ev in evs) and handoff._device_count == 0


def test_a_broken_lent_channel_drops_the_free_ones_with_it():
    """A connection that broke means the reward service restarted or died: the
    free channels reach the same dead process, so they go too, and the count
    lets new ones attach."""
    handoff, evs = _pool(3)
    with handoff.lend(None) as waves:
        waves._ev.channel.closed = True  # the socket broke during the search
    assert handoff._device_free == [] and handoff._device_count == 0
    assert all(ev.channel.closed for ev in evs)
    handoff.close()


def test_a_channel_lent_when_the_evaluator_closes_is_closed_as_it_comes_back():
    handoff, evs = _pool(1)
    with handoff.lend(None) as waves:
        handoff.close()
        assert not waves.closed
    assert evs[0].channel.closes == 1 and handoff._device_count == 0


def test_a_failing_device_attach_is_not_retried_at_every_search(monkeypatch):
    """Top-ups start at most every retry_s: an attach the reward service refuses
    (max_connections, say) must not be repeated by every search."""
    handoff = HandoffEvaluator(channel("127.0.0.1:1"), "connect4_value", "leaf_channel", retry_s=60.0)
    handoff._leaf = LeafChannelEvaluator(_DeviceChannel(), 1.0)  # attached, CUDA regions
    started = []
    monkeypatch.setattr(threading, "Thread", lambda **kw: type("T", (), {"start": lambda self: started.append(kw)})())
    for _ in range(5):
        with handoff.lend(None) as waves:
            assert waves is None
        handoff._topping_up = False  # as if each attach had failed at once
    assert len(started) == 1

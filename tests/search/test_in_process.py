"""In-process waves (tandem/in_process.py, reward_service/in_process.py): in
co-located mode the search service hands its leaf waves to the reward
service of its own process, straight into the critical lane. Here on the
CPU (host waves): the same answers as Evaluate, the hand-off reported, every
bad link and wave refused with its status while the link and the service go
on, and a reward service that stops mid-search (the search keeps its tree,
goes on with rollouts and says why). Device waves: test_in_process_gpu.py."""
from __future__ import annotations


import grpc
import numpy as np
import pytest
from conftest import loopback_config, wait_for
from prometheus_client import REGISTRY
from tandem.v1 import reward_pb2, reward_pb2_grpc
from test_handoff import serving, stopped_mid_search, value_search

from reward_service import in_process as in_process_server
from reward_service import server as reward_server
from reward_service.in_process import InProcessLink
from search_service.games import connect4 as c4
from stack import colocated
from tandem import in_process, tensors
from tandem.leaf_channel import LeafChannelError
from tandem.server import channel
from tandem.deadline import Deadline

MODEL = "connect4_value"


def boards(*moves: str) -> np.ndarray:
    return c4.observation(c4.stack([c4.parse_moves(m) for m in moves]))


@pytest.fixture(scope="module")
def reward():
    """A reward service (CPU) and its in-process server, offered as co-located mode offers it."""
    cfg = loopback_config(reward={"leaf_channel": {"max_rows": 512}})
    service = reward_server.start(cfg, follow_scheduler=False)
    in_process.offer(cfg.reward.address, service.servicer.in_process)
    yield cfg, service
    service.stop()


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(LeafChannelError) as info:
        call()
    return info.value.code, str(info.value)


def test_a_host_wave_answers_as_evaluate_does(reward):
    cfg, service = reward
    link = in_process.find(cfg.reward.address).link(MODEL, 16, device=False)
    x = boards("", "4", "4453", "172737")
    out = link.evaluate(x, Deadline.after_s(30))
    with channel(cfg.reward.address, cfg) as ch:
        reply = reward_pb2_grpc.RewardServiceStub(ch).Evaluate(reward_pb2.EvaluateRequest(
            model=MODEL, inputs=[tensors.to_proto("board", x)], request_class=reward_pb2.REQUEST_CLASS_CRITICAL),
            timeout=30)
    by_name = {t.name: tensors.from_proto(t) for t in reply.outputs}
    assert set(out) == set(by_name) == {"value", "policy_logits"}
    for name, array in out.items():
        assert array.dtype == np.float32 and array.shape == by_name[name].shape
        np.testing.assert_allclose(array, by_name[name], rtol=1e-5, atol=1e-6)
    assert link.bucket >= 4 and link.queue_ms >= 0 and link.compute_ms > 0
    assert link.kind == "system" and link.device_inputs is None and not link.ordered and not link.closed


@pytest.mark.parametrize("model, max_rows, device, code, words", [
    ("nope", 8, False, grpc.StatusCode.NOT_FOUND, "no model named 'nope'"),
    (MODEL, 0, False, grpc.StatusCode.INVALID_ARGUMENT, "max_rows: '0', must be an integer >= 1"),
    (MODEL, 2.5, False, grpc.StatusCode.INVALID_ARGUMENT, "max_rows: '2.5'"),
    (MODEL, True, False, grpc.StatusCode.INVALID_ARGUMENT, "max_rows: 'True'"),
    (MODEL, 8, True, grpc.StatusCode.FAILED_PRECONDITION, "cannot take device waves"),
])
def test_a_bad_port_is_refused_naming_what_was_wrong(reward, model, max_rows, device, code, words):
    cfg, _ = reward
    got, message = code_of(lambda: in_process.find(cfg.reward.address).link(model, max_rows, device))
    assert got == code and words in message


def test_a_port_is_narrowed_to_the_channels_and_the_models_rows(reward):
    cfg, _ = reward
    server = in_process.find(cfg.reward.address)
    assert server.link(MODEL, 4096, device=False).max_rows == 512  # reward.leaf_channel.max_rows
    assert server.link(MODEL, np.int64(64), device=False).max_rows == 64


def test_a_co_located_model_of_few_rows_per_batch_still_goes_in_process():
    """A value model of max_batch_size 16: the search's link (it asks for
    reward.leaf_channel.max_rows) is narrowed to 16, as LeafChannel.offered narrows an attach."""
    models = [{"name": MODEL, "path": "reward_service/models/connect4_value.onnx", "max_batch_size": 16}]
    cfg = loopback_config(reward={"models": models}, search={"backend": "cpu", "value_model_parallel_sims": 8})
    with serving(cfg, *colocated.start(cfg, follow_scheduler=False)) as box:
        handoff = box["search"].servicer.handoff
        assert handoff.wait_attached(10.0) and handoff._leaf.channel.max_rows == 16
        reply = box["stub"].Search(value_search(), timeout=60)
        assert reply.handoff == "in_process" and reply.model_simulations == 64 and not reply.evaluation_failure


def test_bad_waves_are_refused_counted_and_the_port_goes_on(reward):
    cfg, service = reward

    def figure(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, {"model": MODEL, "lane": "critical", **labels}) or 0.0

    before = (figure("tandem_reward_model_requests_total"), figure("tandem_reward_model_request_successes_total"),
              figure("tandem_reward_model_request_failures_total", reason="invalid_input"))
    link = in_process.find(cfg.reward.address).link(MODEL, 4, device=False)
    shapes = (np.zeros((0, 2, 6, 7), np.uint8), np.zeros((5, 2, 6, 7), np.uint8), np.zeros((2, 84), np.uint8),
              np.uint8(1))
    for bad in shapes:
        code, message = code_of(lambda: link.evaluate(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "the link carries 1..4 rows of [2, 6, 7]" in message
    for bad, dtype in ((np.full((1, 2, 6, 7), 0.7), "float64"), ("boards", "<U6"), (np.zeros((1, 2, 6, 7), np.int8), "int8")):
        code, message = code_of(lambda: link.evaluate(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"dtype {dtype}, the model" in message and "uint8" in message
    code, message = code_of(lambda: link.evaluate_device(1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "a host link" in message
    assert link.evaluate(boards("4"))["value"].shape == (1, 1)  # the link goes on
    after = (figure("tandem_reward_model_requests_total"), figure("tandem_reward_model_request_successes_total"),
             figure("tandem_reward_model_request_failures_total", reason="invalid_input"))
    assert [a - b for a, b in zip(after, before)] == [9, 1, 8]


def test_a_wave_past_its_deadline_is_deadline_exceeded_and_never_run(reward):
    cfg, service = reward
    link = in_process.find(cfg.reward.address).link(MODEL, 4, device=False)
    code, message = code_of(lambda: link.evaluate(boards("4"), Deadline.after_s(-0.001)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "not run" in message
    assert link.evaluate(boards("4"), Deadline.after_s(30))["value"].shape == (1, 1)


def test_a_wave_still_running_at_its_deadline_is_deadline_exceeded_and_counted(reward):
    """A wave of 512 rows takes far longer than 5 ms on the CPU: at its deadline
    it is running (or, on a busy machine, still queued: then never run), and
    either way the link answers DEADLINE_EXCEEDED by then, not when the run
    ends; the next wave is served."""
    cfg, _ = reward

    def expired() -> float:
        return REGISTRY.get_sample_value("tandem_reward_model_request_failures_total",
                                         {"model": MODEL, "lane": "critical", "reason": "deadline_exceeded"}) or 0.0

    link = in_process.find(cfg.reward.address).link(MODEL, 512, device=False)
    before = expired()
    x = np.repeat(boards("4453"), 512, axis=0)
    code, message = code_of(lambda: link.evaluate(x, Deadline.after_s(0.005)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and ("still running" in message or "not run" in message)
    assert expired() == before + 1
    assert link.evaluate(boards("4"), Deadline.after_s(60))["value"].shape == (1, 1)


def test_a_run_that_fails_is_internal_counted_and_the_port_goes_on(reward, monkeypatch):
    """Whatever a wave raises past the batcher (here the host outputs' check
    itself failing) is INTERNAL with the error named, and counted."""
    cfg, _ = reward
    link = in_process.find(cfg.reward.address).link(MODEL, 4, device=False)
    monkeypatch.setattr(in_process_server, "wave_output", lambda *args: 1 / 0)
    code, message = code_of(lambda: link.evaluate(boards("4")))
    assert code == grpc.StatusCode.INTERNAL and "division by zero" in message
    monkeypatch.undo()
    assert link.evaluate(boards("4"))["value"].shape == (1, 1)


def test_withdrawing_one_server_leaves_another_offered_under_the_address():
    first, second = object(), object()
    in_process.offer("127.0.0.1:1", first)
    in_process.offer("127.0.0.1:1", second)  # a restart offers its new server under the same address
    in_process.withdraw(first)  # the old one's late close
    assert in_process.find("127.0.0.1:1") is second
    in_process.withdraw(second)
    assert in_process.find("127.0.0.1:1") is None


def test_an_output_that_does_not_fit_the_signature_is_internal_and_nothing_is_returned(reward):
    """The link checks every output against the model's signature (a model
    whose output shape does not fit): INTERNAL, naming the output."""
    cfg, service = reward
    server = in_process.find(cfg.reward.address)
    session = server.sessions[MODEL]
    link = InProcessLink(server, session, 4, "board", (2, 6, 7), np.dtype(np.uint8), [("value", (2,)), ("policy_logits", (7,))],
                device=False)
    code, message = code_of(lambda: link.evaluate(boards("4")))
    assert code == grpc.StatusCode.INTERNAL and "output value is [1, 1], a wave expects [1, 2]" in message


def test_stopping_the_reward_service_withdraws_its_server_and_its_ports_are_unavailable():
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    server = service.servicer.in_process
    in_process.offer(cfg.reward.address, server)
    link = server.link(MODEL, 4, device=False)
    assert in_process.find(cfg.reward.address) is server
    service.stop()
    assert in_process.find(cfg.reward.address) is None and link.closed
    code, message = code_of(lambda: link.evaluate(boards("4")))
    assert code == grpc.StatusCode.UNAVAILABLE and "stopping" in message
    code, _ = code_of(lambda: server.link(MODEL, 4, device=False))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
def co_located():
    cfg = loopback_config(search={"backend": "cpu", "value_model_parallel_sims": 8, "evaluation_cache_bytes": 0})
    with serving(cfg, *colocated.start(cfg, follow_scheduler=False)) as box:
        yield box


def test_a_co_located_search_hands_its_waves_over_in_process(co_located):
    handoff = co_located["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    assert handoff._leaf.handoff == "in_process" and handoff._leaf.channel.path == "in-process"
    reply = co_located["stub"].Search(value_search(), timeout=60)
    assert reply.handoff == "in_process" and reply.model_simulations == reply.simulations == 64
    assert not reply.evaluation_failure and handoff._leaf.totals.calls > 0
    assert handoff.wait_device_channels(0.3) == 0  # the CPU: host waves only, nothing lent


def test_a_co_located_reward_service_stopped_mid_search_leaves_the_tree_and_a_reason(co_located):
    handoff = co_located["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    r = stopped_mid_search(co_located, handoff._leaf)
    assert 0 < r.model_simulations < r.simulations  # the tree built so far was kept, rollouts went on in it
    assert "in process" in r.evaluation_failure and "UNAVAILABLE" in r.evaluation_failure
    assert r.handoff == "in_process" and r.deadline_reached
    assert handoff._leaf is None  # the link was dropped: a new attach finds no reward service in this process
    # A reward service again in this process, offered under the same address: in-process again.
    cfg = co_located["cfg"]
    co_located["reward"] = reward_server.start(cfg, follow_scheduler=False)
    in_process.offer(cfg.reward.address, co_located["reward"].servicer.in_process)
    assert wait_for(lambda: handoff.wait_attached(0.1) and handoff._leaf.handoff == "in_process", 20)
    again = co_located["stub"].Search(value_search(), timeout=60)
    assert again.handoff == "in_process" and again.model_simulations == 64 and not again.evaluation_failure


def test_co_located_and_told_leaf_channel_the_leaves_go_by_the_leaf_channel():
    cfg = loopback_config(search={"backend": "cpu", "value_model_parallel_sims": 8, "handoff": "leaf_channel"})
    with serving(cfg, *colocated.start(cfg, follow_scheduler=False)) as box:
        handoff = box["search"].servicer.handoff
        assert handoff.wait_attached(10.0) and handoff._leaf.handoff == "leaf_channel"
        assert box["stub"].Search(value_search(), timeout=60).handoff == "leaf_channel"

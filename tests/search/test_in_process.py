"""In-process waves (tandem/in_process.py, reward_service/in_process.py): in
co-located mode the search service hands its leaf waves to the reward
service of its own process, straight into the critical lane. Here on the
CPU (host waves): the same answers as Evaluate, the hand-off reported, every
bad port and wave refused with its status while the port and the service go
on, and a reward service that stops mid-search (the search keeps its tree,
goes on with rollouts and says why). Device waves: test_in_process_gpu.py."""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from conftest import loopback_config
from prometheus_client import REGISTRY
from tandem.v1 import reward_pb2, reward_pb2_grpc
from test_handoff import serving, stopped_mid_search, value_search

from reward_service import server as reward_server
from reward_service.in_process import Port
from search_service.games import connect4 as c4
from stack import colocated
from tandem import in_process, tensors
from tandem.leaf_channel import LeafChannelError
from tandem.server import channel

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
    port = in_process.find(cfg.reward.address).port(MODEL, 16, device=False)
    x = boards("", "4", "4453", "172737")
    out = port.evaluate(x, time.monotonic() + 30)
    with channel(cfg.reward.address, cfg) as ch:
        reply = reward_pb2_grpc.RewardServiceStub(ch).Evaluate(reward_pb2.EvaluateRequest(
            model=MODEL, inputs=[tensors.to_proto("board", x)], request_class=reward_pb2.REQUEST_CLASS_CRITICAL),
            timeout=30)
    by_name = {t.name: tensors.from_proto(t) for t in reply.outputs}
    assert set(out) == set(by_name) == {"value", "policy_logits"}
    for name, array in out.items():
        assert array.dtype == np.float32 and array.shape == by_name[name].shape
        np.testing.assert_allclose(array, by_name[name], rtol=1e-5, atol=1e-6)
    assert port.bucket >= 4 and port.queue_ms >= 0 and port.compute_ms > 0
    assert port.kind == "system" and port.device_inputs is None and not port.ordered and not port.closed


@pytest.mark.parametrize("model, max_rows, device, code, words", [
    ("nope", 8, False, grpc.StatusCode.NOT_FOUND, "no model named 'nope'"),
    (MODEL, 0, False, grpc.StatusCode.INVALID_ARGUMENT, "max_rows: '0', must be 1..512"),
    (MODEL, 513, False, grpc.StatusCode.INVALID_ARGUMENT, "max_rows: '513'"),
    (MODEL, True, False, grpc.StatusCode.INVALID_ARGUMENT, "max_rows: 'True'"),
    (MODEL, 8, True, grpc.StatusCode.FAILED_PRECONDITION, "cannot take device waves"),
])
def test_a_bad_port_is_refused_naming_what_was_wrong(reward, model, max_rows, device, code, words):
    cfg, _ = reward
    got, message = code_of(lambda: in_process.find(cfg.reward.address).port(model, max_rows, device))
    assert got == code and words in message


def test_bad_waves_are_refused_counted_and_the_port_goes_on(reward):
    cfg, service = reward

    def figure(name: str, **labels) -> float:
        return REGISTRY.get_sample_value(name, {"model": MODEL, "lane": "critical", **labels}) or 0.0

    before = (figure("tandem_reward_model_requests_total"), figure("tandem_reward_model_request_successes_total"),
              figure("tandem_reward_model_request_failures_total", reason="invalid_input"))
    port = in_process.find(cfg.reward.address).port(MODEL, 4, device=False)
    for bad in (np.zeros((0, 2, 6, 7), np.uint8), np.zeros((5, 2, 6, 7), np.uint8), np.zeros((2, 84), np.uint8)):
        code, message = code_of(lambda: port.evaluate(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "the port carries 1..4 rows of [2, 6, 7]" in message
    code, message = code_of(lambda: port.evaluate_device(1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "a host port" in message
    assert port.evaluate(boards("4"))["value"].shape == (1, 1)  # the port goes on
    after = (figure("tandem_reward_model_requests_total"), figure("tandem_reward_model_request_successes_total"),
             figure("tandem_reward_model_request_failures_total", reason="invalid_input"))
    assert [a - b for a, b in zip(after, before)] == [5, 1, 4]


def test_a_wave_past_its_deadline_is_deadline_exceeded_and_never_run(reward):
    cfg, service = reward
    port = in_process.find(cfg.reward.address).port(MODEL, 4, device=False)
    code, message = code_of(lambda: port.evaluate(boards("4"), time.monotonic() - 0.001))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "not run" in message
    assert port.evaluate(boards("4"), time.monotonic() + 30)["value"].shape == (1, 1)


def test_an_output_that_does_not_fit_the_signature_is_internal_and_nothing_is_returned(reward):
    """The port checks every output against the model's signature (a model
    whose output shape does not fit): INTERNAL, naming the output."""
    cfg, service = reward
    server = in_process.find(cfg.reward.address)
    session = server.sessions[MODEL]
    port = Port(server, session, 4, "board", (2, 6, 7), np.dtype(np.uint8), [("value", (2,)), ("policy_logits", (7,))],
                device=False)
    code, message = code_of(lambda: port.evaluate(boards("4")))
    assert code == grpc.StatusCode.INTERNAL and "output value is [1, 1], a wave expects [1, 2]" in message


def test_stopping_the_reward_service_withdraws_its_server_and_its_ports_are_unavailable():
    cfg = loopback_config()
    service = reward_server.start(cfg, follow_scheduler=False)
    server = service.servicer.in_process
    in_process.offer(cfg.reward.address, server)
    port = server.port(MODEL, 4, device=False)
    assert in_process.find(cfg.reward.address) is server
    service.stop()
    assert in_process.find(cfg.reward.address) is None and port.closed
    code, message = code_of(lambda: port.evaluate(boards("4")))
    assert code == grpc.StatusCode.UNAVAILABLE and "stopping" in message
    code, _ = code_of(lambda: server.port(MODEL, 4, device=False))
    assert code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
def co_located():
    cfg = loopback_config(search={"backend": "cpu", "value_model_parallel_sims": 8, "evaluation_cache_bytes": 0})
    with serving(cfg, *colocated.start(cfg, follow_scheduler=False)) as box:
        yield box


def test_a_co_located_search_hands_its_waves_over_in_process(co_located):
    handoff = co_located["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    assert handoff._ipc.handoff == "in_process" and handoff._ipc.channel.path == "in-process"
    reply = co_located["stub"].Search(value_search(), timeout=60)
    assert reply.handoff == "in_process" and reply.model_simulations == reply.simulations == 64
    assert not reply.evaluation_failure and handoff._ipc.totals.calls > 0
    assert handoff.wait_device_channels(0.3) == 0  # the CPU: host waves only, nothing lent


def test_a_co_located_reward_service_stopped_mid_search_leaves_the_tree_and_a_reason(co_located):
    handoff = co_located["search"].servicer.handoff
    assert handoff.wait_attached(10.0)
    r = stopped_mid_search(co_located, handoff._ipc)
    assert 0 < r.model_simulations < r.simulations  # the tree built so far was kept, rollouts went on in it
    assert "in process" in r.evaluation_failure and "UNAVAILABLE" in r.evaluation_failure
    assert r.handoff == "in_process" and r.deadline_reached
    assert handoff._ipc is None  # the port was dropped: a new attach finds no reward service in this process

"""The critical path while the reward service is down: its bulk server is its
standby (reward.bulk_server.standby), and tandem's frame client sends a
frame's critical Evaluate there until the reward service serves again
(tandem/failover.py). Real gRPC servers on loopback (CPU), the shipped value
model, real Pons positions."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from conftest import loopback_config, wait_for
from tandem.v1 import reward_pb2, reward_pb2_grpc

from reward_service import server as reward_server
from search_service.games import connect4 as c4
from stack.frame_loop import FrameClient, Tick
from tandem import tensors
from tandem.failover import STANDBY_KEY, Failover
from tandem.positions import load_set
from tandem.server import channel, health_status

MODEL = "connect4_value"


@pytest.fixture
def stack():
    """The reward service and its standby bulk server; the test may stop and restart the former."""
    cfg = loopback_config(reward={"intra_op_threads": 1})
    services = {"primary": reward_server.start(cfg, follow_scheduler=False),
                "standby": reward_server.start(cfg, follow_scheduler=False, bulk_server=True)}
    yield cfg, services
    for s in services.values():
        s.stop()


def boards(n: int) -> np.ndarray:
    """uint8 [n, 2, 6, 7]: the first n positions of the bundled Test_L2_R1 set."""
    return c4.observation(c4.stack([c4.parse_moves(p.moves) for p in load_set("Test_L2_R1")[:n]]))


def critical(stub, n: int = 1) -> np.ndarray:
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", boards(n))],
                                                     request_class=reward_pb2.REQUEST_CLASS_CRITICAL), timeout=30)
    return tensors.from_proto(reply.outputs[0])


def test_the_standby_answers_critical_requests_as_the_reward_service_does(stack):
    cfg, _ = stack
    with channel(cfg.reward.address, cfg) as front, channel(cfg.reward.bulk_server.address, cfg) as bulk:
        f, b = reward_pb2_grpc.RewardServiceStub(front), reward_pb2_grpc.RewardServiceStub(bulk)
        np.testing.assert_allclose(critical(b, 8), critical(f, 8), atol=1e-6)
        meta = f.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL), timeout=10).runtime
        assert meta[STANDBY_KEY] == cfg.reward.bulk_server.address
        standby = b.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL), timeout=10).runtime
        assert standby["role"] == "bulk server, standby for critical requests"


def _frame(client: FrameClient, frame: int):
    obs = boards(1)
    sent = client.send(Tick(0, frame, 0.0), "4453", simulations=8, evaluator="rollout", seed=frame,
                       timeout_s=30.0, evaluate=lambda: obs)
    assert sent.wait(60)
    return next(r for r in sent.records if r.kind == "evaluate")


def test_frames_go_to_the_standby_while_the_reward_service_is_down_and_come_back(stack):
    cfg, services = stack
    from search_service import server as search_server

    search_cfg = loopback_config(search={"backend": "cpu"})
    search = search_server.start(search_cfg, follow_scheduler=False)
    client = FrameClient(search_cfg.search.address, cfg.reward.address, cfg, model=MODEL)
    try:
        first = _frame(client, 0)
        assert (first.code, first.server) == ("OK", "primary")
        services["primary"].stop()  # the reward service goes away (as a killed process's port refuses)
        down = [_frame(client, i) for i in range(1, 6)]
        assert [(r.code, r.server) for r in down] == [("OK", "standby")] * 5
        services["primary"] = reward_server.start(cfg, follow_scheduler=False)  # back, on its address
        assert wait_for(lambda: health_status(cfg.reward.address, cfg) == "SERVING", 30)
        assert wait_for(lambda: _frame(client, 9).server == "primary", 30)  # clients move back by themselves
    finally:
        client.close()
        search.stop()


class _Done:
    """A finished call, as a grpc.Future: its code, or its answer."""

    def __init__(self, code: grpc.StatusCode, answer=None):
        self.code, self.answer = code, answer

    def result(self, timeout=None):
        if self.code != grpc.StatusCode.OK:
            raise _Error(self.code)
        return self.answer

    def add_done_callback(self, fn):
        fn(self)


class _Error(grpc.RpcError):
    def __init__(self, code):
        super().__init__()
        self._code = code

    def code(self):
        return self._code


def test_only_unavailable_moves_a_call_and_only_within_its_deadline():
    now = [0.0]
    calls = []

    def server(name, code):
        def send(request, timeout):
            calls.append((name, round(timeout, 3)))
            return _Done(code, name)
        return send

    # A primary that refuses a request as bad input answers the caller: no retry elsewhere.
    f = Failover(server("primary", grpc.StatusCode.INVALID_ARGUMENT), server("standby", grpc.StatusCode.OK),
                 clock=lambda: now[0])
    with pytest.raises(grpc.RpcError):
        f.future("r", timeout=1.0).result()
    assert calls == [("primary", 1.0)]
    # UNAVAILABLE: the standby gets the time left; later calls skip the primary for retry_primary_s.
    calls.clear()
    f = Failover(server("primary", grpc.StatusCode.UNAVAILABLE), server("standby", grpc.StatusCode.OK),
                 retry_primary_s=0.25, clock=lambda: now[0])
    assert f.future("r", timeout=1.0).result() == "standby"
    now[0] = 0.1
    assert f.future("r", timeout=1.0).result() == "standby"
    now[0] = 0.5
    assert f.future("r", timeout=1.0).result() == "standby"
    assert calls == [("primary", 1.0), ("standby", 1.0), ("standby", 1.0), ("primary", 1.0), ("standby", 1.0)]
    # No standby: the primary's answer, whatever it is.
    with pytest.raises(grpc.RpcError) as info:
        Failover(server("primary", grpc.StatusCode.UNAVAILABLE), None).future("r", timeout=1.0).result()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_reference_engine_client_evaluates_on_the_standby_while_the_reward_service_is_down(stack):
    from tandem.engine_client import EngineClient

    cfg, services = stack
    with channel(cfg.reward.address, cfg) as reward, channel(cfg.reward.bulk_server.address, cfg) as standby:
        client = EngineClient(reward, reward, standby=standby)  # the search channel is not used here
        before = client.evaluate(MODEL, {"board": boards(2)}, timeout_s=30)
        services["primary"].stop()
        during = client.evaluate(MODEL, {"board": boards(2)}, timeout_s=30)
        assert during is not None and before is not None
        np.testing.assert_allclose(during["value"], before["value"], atol=1e-6)

"""The reward service's bulk server (reward.bulk_server): a second reward
server for bulk clients, beside the reward service; both real gRPC servers on
loopback (CPU), with the shipped models and real Pons positions."""
from __future__ import annotations

import re

import grpc
import numpy as np
import pytest
from conftest import free_port, loopback_config
from prometheus_client import REGISTRY
from tandem.v1 import reward_pb2, reward_pb2_grpc

from reward_service import server as reward_server
from reward_service.batcher import BULK, CRITICAL
from reward_service.session import ModelSession, runners_per_model
from search_service.games import connect4 as c4
from tandem import tensors
from tandem.config import ConfigError, bulk_address, load_config, parse_config
from tandem.engine_client import handshake
from tandem.positions import load_set
from tandem.server import channel, health_status
from tandem.shared_memory_client import SystemSharedMemoryRegion

MODEL = "connect4_value"


@pytest.fixture(scope="module")
def servers():
    # standby off: a bulk server for bulk clients alone (the standby: tests/reward/test_failover.py)
    cfg = loopback_config(reward={"intra_op_threads": 1, "bulk_server": {
        "enabled": True, "address": f"127.0.0.1:{free_port()}", "metrics_port": 0, "standby": False}})
    front = reward_server.start(cfg, follow_scheduler=False)
    bulk = reward_server.start(cfg, follow_scheduler=False, bulk_server=True)
    channels = [channel(cfg.reward.address, cfg), channel(cfg.reward.bulk_server.address, cfg)]
    yield cfg, front, bulk, [reward_pb2_grpc.RewardServiceStub(ch) for ch in channels], channels
    for ch in channels:
        ch.close()
    bulk.stop()
    front.stop()


def pons_boards(n: int) -> np.ndarray:
    """uint8 [n, 2, 6, 7]: the first n positions of the bundled Test_L2_R1 set."""
    labelled = load_set("Test_L2_R1")[:n]
    return c4.observation(c4.stack([c4.parse_moves(p.moves) for p in labelled]))


def evaluate(stub, boards, request_class=reward_pb2.REQUEST_CLASS_BULK, model=MODEL):
    reply = stub.Evaluate(reward_pb2.EvaluateRequest(model=model, inputs=[tensors.to_proto("board", boards)],
                                                     request_class=request_class), timeout=30)
    return {t.name: tensors.from_proto(t) for t in reply.outputs}


def test_a_bulk_evaluate_at_the_bulk_server_is_the_reward_services_answer(servers):
    _, _, _, (front, bulk), _ = servers
    boards = pons_boards(64)
    expected, got = evaluate(front, boards), evaluate(bulk, boards)
    assert set(got) == set(expected) == {"value", "policy_logits"}
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6)
    assert got["value"].shape == (64, 1) and np.all(np.abs(got["value"]) <= 1)


def test_a_critical_evaluate_at_the_bulk_server_is_refused_naming_the_reward_service(servers):
    cfg, _, _, (_, bulk), _ = servers
    before = _wrong_server_failures()
    with pytest.raises(grpc.RpcError) as info:
        evaluate(bulk, pons_boards(1), reward_pb2.REQUEST_CLASS_CRITICAL)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "bulk server" in info.value.details() and cfg.reward.address in info.value.details()
    assert _wrong_server_failures() == before + 1  # counted in the model's metrics, with its reason
    # The server keeps serving: bulk work, and an unspecified class (bulk by the contract).
    assert evaluate(bulk, pons_boards(2))["value"].shape == (2, 1)
    assert evaluate(bulk, pons_boards(2), reward_pb2.REQUEST_CLASS_UNSPECIFIED)["value"].shape == (2, 1)


def _wrong_server_failures() -> float:
    return REGISTRY.get_sample_value("tandem_reward_model_request_failures_total",
                                     {"model": MODEL, "lane": "critical", "reason": "wrong_server"}) or 0.0


def test_the_open_inference_protocol_at_the_bulk_server_serves_the_bulk_lane_only(servers):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    cfg = servers[0]
    boards = pons_boards(2)
    x = grpcclient.InferInput("board", list(boards.shape), "UINT8")
    x.set_data_from_numpy(boards)
    client = grpcclient.InferenceServerClient(cfg.reward.bulk_server.address)
    try:
        with pytest.raises(InferenceServerException) as info:  # priority 1: the critical lane
            client.infer(MODEL, [x], priority=1, client_timeout=30)
        assert "FAILED_PRECONDITION" in str(info.value.status()) and cfg.reward.address in info.value.message()
        assert client.infer(MODEL, [x], priority=2, client_timeout=30).as_numpy("value").shape == (2, 1)
        # Its model config lists the instances it has: the bulk lane's, no critical one.
        groups = [g.name for g in client.get_model_config(MODEL).config.instance_group]
        assert groups == [f"{MODEL}_bulk"]
    finally:
        client.close()
    front = grpcclient.InferenceServerClient(cfg.reward.address)
    try:
        groups = [g.name for g in front.get_model_config(MODEL).config.instance_group]
        assert groups == [f"{MODEL}_critical", f"{MODEL}_bulk"]
    finally:
        front.close()


def test_bad_input_at_the_bulk_server_is_invalid_argument_and_it_keeps_serving(servers):
    _, _, _, (_, bulk), _ = servers
    with pytest.raises(grpc.RpcError) as info:
        evaluate(bulk, pons_boards(2).astype(np.float32))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dtype" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        evaluate(bulk, pons_boards(2), model="no_such_model")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert evaluate(bulk, pons_boards(3))["value"].shape == (3, 1)


def test_each_server_names_the_other_and_only_the_reward_service_has_a_leaf_channel(servers):
    cfg, _, _, (front, bulk), channels = servers
    f = front.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL), timeout=10).runtime
    b = bulk.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL), timeout=10).runtime
    assert f["role"] == "reward service" and f["bulk_server"] == cfg.reward.bulk_server.address
    assert b["role"] == "bulk server" and b["critical_server"] == cfg.reward.address
    assert "leaf_channel" in f and "leaf_channel" not in b
    assert b["lanes"].startswith("bulk only")
    # No critical lane, so no priority for it (0 would read as a critical lane at the least priority).
    assert b["stream_priority_critical_lane"] == "none" and f["stream_priority_critical_lane"].lstrip("-").isdigit()
    assert "reward.bulk_server" in handshake(channels[0], "tandem.v1.RewardService", ()).capabilities
    caps = handshake(channels[1], "tandem.v1.RewardService", ("reward.bulk_only",)).capabilities
    assert "reward.leaf_channel" not in caps and "reward.bulk_server" not in caps


def test_shared_memory_regions_are_the_bulk_servers_own(servers):
    _, front_service, bulk_service, (front, bulk), _ = servers
    boards = pons_boards(16)
    expected = evaluate(front, boards)
    with SystemSharedMemoryRegion(bulk, 1 << 16) as region:
        got, reply = region.evaluate(MODEL, {"board": boards})
        assert all(t.WhichOneof("contents") == "shared_memory" for t in reply.outputs)
        assert bulk_service.servicer.regions.stats()["regions"] == 1
        assert front_service.servicer.regions.stats()["regions"] == 0  # registered there, not here
        # Named at the reward service, the bulk server's region is unknown.
        with pytest.raises(grpc.RpcError) as info:
            front.Evaluate(region.stage(MODEL, {"board": boards}), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], atol=1e-6)
    assert bulk_service.servicer.regions.stats()["regions"] == 0


def test_the_bulk_servers_models_hold_no_critical_runner():
    cfg = load_config().reward
    model = next(m for m in cfg.models if m.name == MODEL)
    for host_binding in (False, True):  # the CPU path, and the IO-binding path over host buffers
        session = ModelSession(model, cfg, host_binding=host_binding, critical_lane=False)
        assert session.lane_runners(CRITICAL) == [] and len(session.lane_runners(BULK)) >= 1
        assert session.lane_runners() == session.lane_runners(BULK)
        assert session.critical_stream_priority == 0 and session.runtime["lanes"].startswith("bulk only")
        assert len(next(iter(session.run({"board": pons_boards(2)})[0].values()))) == 2  # bulk runs
    assert runners_per_model(cfg, critical_lane=False) == runners_per_model(cfg) - 1 == len(cfg.stream_priorities)


def test_the_shipped_config_runs_a_bulk_server_and_the_container_config_none():
    shipped = load_config()
    assert shipped.reward.bulk_server.enabled and bulk_address(shipped) == shipped.reward.bulk_server.address
    container = load_config("deploy/config/tandem.container.yaml")
    assert not container.reward.bulk_server.enabled and bulk_address(container) == container.reward.address


@pytest.mark.parametrize("bulk, message", [
    ({"address": "127.0.0.1:50051"}, "reward.bulk_server.address: 127.0.0.1:50051 is also reward.address"),
    ({"metrics_port": 9451}, "reward.bulk_server.metrics_port: 127.0.0.1:9451 is also reward.metrics_port"),
    ({"address": "no-port"}, "reward.bulk_server.address: expected HOST:PORT"),
    ({"colour": "blue"}, "reward.bulk_server.colour: unknown key"),
    # One port of this host, however the hosts are spelled (every interface, localhost, leading zeros).
    ({"address": "0.0.0.0:50051"}, "reward.bulk_server.address: 0.0.0.0:50051 is also reward.address"),
    ({"address": "localhost:50052"}, "search.address: 127.0.0.1:50052 is also reward.bulk_server.address "
                                     "(localhost:50052)"),
    ({"address": "127.0.0.1:050050"}, "reward.bulk_server.address: 127.0.0.1:50050 is also scheduler.address"),
    ({"address": "[::]:9452"}, "search.metrics_port: 127.0.0.1:9452 is also reward.bulk_server.address ([::]:9452)"),
])
def test_a_bulk_server_on_another_servers_port_or_with_a_bad_key_is_refused_naming_it(bulk, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({"reward": {"bulk_server": {"enabled": True, **bulk}}})


def test_servers_on_one_port_of_distinct_loopback_addresses_do_not_clash():
    # 127.0.0.1 and [::1] are two sockets; so are two distinct interfaces.
    cfg = parse_config({"reward": {"bulk_server": {"address": "[::1]:50051"}}})
    assert bulk_address(cfg) == "[::1]:50051"
    parse_config({"reward": {"address": "10.0.0.1:50051", "bulk_server": {"address": "10.0.0.2:50051"}}})


def test_a_disabled_bulk_server_takes_no_port():
    cfg = parse_config({"reward": {"bulk_server": {"enabled": False, "address": "127.0.0.1:50051"}}})
    assert bulk_address(cfg) == cfg.reward.address


def test_the_value_model_may_not_call_the_bulk_server():
    data = {"reward": {"bulk_server": {"address": "127.0.0.1:50053"}}, "search": {"reward_address": "127.0.0.1:50053"}}
    with pytest.raises(ConfigError, match=r"search\.reward_address: 127\.0\.0\.1:50053 is the reward service's bulk"):
        parse_config(data)
    data["reward"]["bulk_server"]["enabled"] = False  # no bulk server: whatever listens there is the user's
    assert parse_config(data).search.reward_address == "127.0.0.1:50053"


def test_a_bulk_server_the_config_turns_off_is_not_started():
    cfg = loopback_config(reward={"bulk_server": {"enabled": False, "address": f"127.0.0.1:{free_port()}"}})
    with pytest.raises(RuntimeError, match=r"reward\.bulk_server\.enabled is false"):
        reward_server.start(cfg, follow_scheduler=False, bulk_server=True)
    assert health_status(cfg.reward.bulk_server.address, cfg, timeout_s=0.5) != "SERVING"

"""Co-located mode (stack/colocated.py): reward and search in one process."""
from __future__ import annotations

import time

import grpc
import yaml
from conftest import free_port, loopback_config
from prometheus_client import REGISTRY
from tandem.v1 import (
    reward_pb2,
    reward_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    search_pb2,
    search_pb2_grpc,
)

from stack import colocated
from stack.supervisor import Stack
from tandem.config import load_config, loopback_data
from tandem.server import channel, health_status

WAIT_S = 10.0


def test_both_services_serve_from_one_process_and_search_uses_the_reward_model():
    cfg = loopback_config(search={"backend": "cpu"})
    reward, search = colocated.start(cfg, follow_scheduler=False)
    try:
        with channel(cfg.search.address, cfg) as ch:
            reply = search_pb2_grpc.SearchServiceStub(ch).Search(search_pb2.SearchRequest(
                game="connect4", moves="44", simulations=32, evaluator=search_pb2.EVALUATOR_VALUE_MODEL, seed=1),
                timeout=WAIT_S)
        assert reply.evaluator == search_pb2.EVALUATOR_VALUE_MODEL  # the reward service answered, in-process
        with channel(cfg.reward.address, cfg) as ch:
            meta = reward_pb2_grpc.RewardServiceStub(ch).ModelMetadata(
                reward_pb2.ModelMetadataRequest(model="frame_reward"), timeout=WAIT_S)
        assert meta.name == "frame_reward"
        assert meta.runtime["stream_priority_assigned"] == "0"  # nothing assigned yet (no scheduler followed)
        assert REGISTRY.get_sample_value("tandem_reward_queue_depth") == 0
        assert REGISTRY.get_sample_value("tandem_reward_pool_limit_bytes") == 0
    finally:
        search.stop()
        reward.stop()


def test_tandem_up_starts_two_processes_when_co_located(tmp_path):
    data = loopback_data(free_port, bulk_server=False)
    data["search"]["backend"] = "cpu"
    data["scheduler"]["report_interval_ms"] = 50
    data["co_located"] = True
    path = tmp_path / "tandem.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_config(path)
    stack = Stack(cfg, path)
    stack.start()
    try:
        assert list(stack.procs) == ["scheduler", "co_located"]
        assert health_status(cfg.reward.address, cfg) == health_status(cfg.search.address, cfg) == "SERVING"
        with grpc.insecure_channel(cfg.scheduler.address) as ch:
            stub = scheduler_pb2_grpc.SchedulerStub(ch)
            end = time.monotonic() + WAIT_S
            kinds: set = set()
            while len(kinds) < 2 and time.monotonic() < end:  # both register, from one process
                kinds = {s.kind for s in stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S).services}
                time.sleep(0.02)
        assert kinds == {scheduler_pb2.SERVICE_KIND_SEARCH, scheduler_pb2.SERVICE_KIND_REWARD}
    finally:
        codes = stack.stop()
    assert codes == {"scheduler": 0, "co_located": 0}

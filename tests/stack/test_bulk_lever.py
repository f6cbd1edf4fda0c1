"""The scheduler's lever over bulk work, end to end: a real scheduler and a
real reward service following it on loopback (issue 12, part 3)."""
from __future__ import annotations

import time

import numpy as np
from conftest import free_port, loopback_config
from tandem.v1 import reward_pb2, reward_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

from reward_service import server as reward_server
from scheduler.main import start as start_scheduler
from tandem import tensors
from tandem.device import cpu_only
from tandem.server import channel

WAIT_S = 30.0
MODEL = "connect4_value"


def _wait_for(fn, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not seen within {WAIT_S} s")


def test_static_bulk_share_reaches_every_bulk_lane_and_critical_latency_reaches_the_scheduler():
    cfg = loopback_config(reward={"execution_provider": "cpu"},
                          scheduler={"policy": "static", "report_interval_ms": 100})
    sched = start_scheduler(cfg, device=cpu_only())
    reward = reward_server.start(cfg, follow_scheduler=True)
    try:
        with channel(cfg.reward.address, cfg) as rch, channel(cfg.scheduler.address, cfg) as sch:
            stub = reward_pb2_grpc.RewardServiceStub(rch)
            sched_stub = scheduler_pb2_grpc.SchedulerStub(sch)
            share = str(cfg.scheduler.urgency.static_bulk_share_percent)

            def runtime():
                return stub.ModelMetadata(reward_pb2.ModelMetadataRequest(model=MODEL), timeout=10).runtime

            _wait_for(lambda: runtime()["bulk_share_percent"] == share, "the static bulk share in ModelMetadata")
            assert all(b.bulk_share == int(share) for b in reward.servicer.batchers.values())
            board = np.zeros((1, 2, 6, 7), np.uint8)
            for request_class in (reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK):
                stub.Evaluate(reward_pb2.EvaluateRequest(model=MODEL, inputs=[tensors.to_proto("board", board)],
                                                         request_class=request_class), timeout=10)

            def reward_row():
                rows = sched_stub.Status(scheduler_pb2.StatusRequest(), timeout=10).services
                row = next((r for r in rows if r.kind == scheduler_pb2.SERVICE_KIND_REWARD), None)
                return row if row is not None and row.last_load.critical_latency_ms > 0 else None

            row = _wait_for(reward_row, "the critical request's latency in the reward service's load report")
            assert row.assignment.bulk_share_percent == int(share)
    finally:
        reward.stop()
        sched.stop(grace_ms=0)


def test_frames_at_risk_at_the_reward_service_hold_back_its_bulk_servers_bulk_lane():
    """The bulk server registers as a reward service of its own: the dynamic
    lever, steered by the reward service's critical latency, lowers the bulk
    server's bulk share too (its own reports carry no critical latency)."""
    cfg = loopback_config(
        reward={"execution_provider": "cpu", "bulk_server": {"enabled": True, "address": f"127.0.0.1:{free_port()}",
                                                              "metrics_port": 0}},
        scheduler={"policy": "dynamic", "report_interval_ms": 50,
                   # Any critical request puts frames at risk: this test is about where the lever reaches.
                   "urgency": {"bulk_raise_critical_ms": 0.002, "bulk_lower_critical_ms": 0.001}})
    sched = start_scheduler(cfg, device=cpu_only())
    reward = reward_server.start(cfg, follow_scheduler=True)
    bulk = reward_server.start(cfg, follow_scheduler=True, bulk_server=True)
    try:
        with channel(cfg.reward.address, cfg) as rch, channel(cfg.scheduler.address, cfg) as sch:
            stub = reward_pb2_grpc.RewardServiceStub(rch)
            sched_stub = scheduler_pb2_grpc.SchedulerStub(sch)
            request = reward_pb2.EvaluateRequest(model=MODEL, request_class=reward_pb2.REQUEST_CLASS_CRITICAL,
                                                 inputs=[tensors.to_proto("board", np.zeros((1, 2, 6, 7), np.uint8))])

            def bulk_server_held_back():
                stub.Evaluate(request, timeout=10)  # a critical latency in every report window
                rows = sched_stub.Status(scheduler_pb2.StatusRequest(), timeout=10).services
                row = next((r for r in rows if r.address == cfg.reward.bulk_server.address), None)
                return row is not None and 0 < row.assignment.bulk_share_percent < 100

            _wait_for(bulk_server_held_back, "the bulk server's bulk share lowered while frames are at risk")
            assert _wait_for(lambda: all(b.bulk_share < 100 for b in bulk.servicer.batchers.values()),
                             "the lowered share applied to the bulk server's batchers")
            rows = sched_stub.Status(scheduler_pb2.StatusRequest(), timeout=10).services
            assert sum(r.kind == scheduler_pb2.SERVICE_KIND_REWARD for r in rows) == 2
    finally:
        bulk.stop()
        reward.stop()
        sched.stop(grace_ms=0)

"""Channels made by ``tandem.server.channel`` are connected again within about a
second of their peer coming back, however long it was away.

gRPC's default reconnect backoff (1 s, x1.6 per failed attempt, up to 120 s)
left a channel failing UNAVAILABLE for 4-15 s after a server that had been down
for 20-60 s was serving again."""
from __future__ import annotations

import time

import grpc
import pytest
from conftest import free_port, loopback_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.server import build_server, channel

OUTAGE_S = 20.0  # long enough for gRPC's default backoff to have grown to ~10 s
RECONNECTED_WITHIN_S = 2.5  # the capped backoff gives ~0.6 s; the old one 1-10 s after this outage


def _serve(address: str, cfg):
    running = build_server(address, cfg.search.server, cfg, register=[])
    running.set_serving(True)
    return running


def _check(stub) -> bool:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError as exc:
        assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), exc
        return False


@pytest.mark.slow
def test_channel_reconnects_within_a_second_or_two_of_the_server_restarting():
    cfg = loopback_config()
    address = f"127.0.0.1:{free_port()}"
    running = _serve(address, cfg)
    with channel(address, cfg) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        assert _check(stub)
        running.server.stop(0).wait()
        # A client that keeps calling through the outage, as a game engine does:
        # every failed call is a reconnect attempt that grows gRPC's backoff.
        end = time.monotonic() + OUTAGE_S
        while time.monotonic() < end:
            assert not _check(stub)
            time.sleep(0.1)
        running = _serve(address, cfg)  # the same port
        try:
            back = time.monotonic()
            while not _check(stub):
                assert time.monotonic() - back < 30, "the channel never reconnected"
                time.sleep(0.02)
            took = time.monotonic() - back
        finally:
            running.server.stop(0)
    assert took < RECONNECTED_WITHIN_S, f"reconnected {took:.2f} s after the server was back"

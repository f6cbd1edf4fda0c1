"""A stopping server ends its open health Watch streams (issue 40: an open
``grpc.health.v1.Health/Watch`` made every SIGTERM wait the whole grace
period, as grpc-dotnet #2582 describes): the stream gets NOT_SERVING, then
ends with OK, and the stop does not wait for the grace. Real servers on
loopback."""
from __future__ import annotations

import threading

import grpc
from conftest import loopback_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from search_service import server as search_server
from tandem.server import channel

GRACE_MS = 60_000.0  # a stop held by the stream would take this long, and end it CANCELLED


def _watch(address: str, cfg):
    """Opens a Watch of the whole server; returns (statuses seen, the end's code, done event, channel)."""
    ch = channel(address, cfg)
    seen, end, done = [], [], threading.Event()
    first = threading.Event()

    def read():
        try:
            for reply in health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=600):
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                first.set()
            end.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            end.append(exc.code())
        finally:
            first.set()
            done.set()

    threading.Thread(target=read, daemon=True).start()
    assert first.wait(30)
    return seen, end, done, ch


def test_stop_ends_open_health_watches_without_waiting_for_the_grace():
    cfg = loopback_config(search={"backend": "cpu"})
    service = search_server.start(cfg, follow_scheduler=False)
    seen, end, done, ch = _watch(cfg.search.address, cfg)
    try:
        assert seen == ["SERVING"]
        stopped = threading.Event()
        threading.Thread(target=lambda: (service.stop(GRACE_MS), stopped.set()), daemon=True).start()
        assert done.wait(GRACE_MS / 1000 / 2), "the Watch stream was not ended by the stop"
        assert seen == ["SERVING", "NOT_SERVING"] and end == [grpc.StatusCode.OK]
        assert stopped.wait(GRACE_MS / 1000 / 2), "the stop waited for the grace"
    finally:
        ch.close()

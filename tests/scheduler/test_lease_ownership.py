"""A lease is its holder's (issue 13, kind 7): the lease id is a secret that
``Status`` never shows, a live lease is not taken over by anyone who learns the
instance name, and watch streams are limited per lease and per peer host, so
that one client cannot take every watch slot. Real scheduler on loopback, no
token (the default on loopback)."""
from __future__ import annotations

import os

import grpc
import pytest
from conftest import free_port, loopback_config
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

from scheduler.main import start
from scheduler.server import MAX_WATCHES_PER_LEASE, peer_host
from tandem.device import cpu_only

C = grpc.StatusCode
SEARCH = scheduler_pb2.SERVICE_KIND_SEARCH
WAIT_S = 5.0


def _register(stub, instance: str, pid: int):
    return stub.Register(scheduler_pb2.RegisterRequest(
        kind=SEARCH, instance=instance, address="127.0.0.1:50052", stream_priorities=[0], pid=pid), timeout=WAIT_S)


def _error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


@pytest.fixture
def scheduler():
    """A scheduler on every interface of a free port (so that clients can come
    from two peer hosts, 127.0.0.1 and ::1); yields ``channel(host)``."""
    cfg = loopback_config(scheduler={"address": f"[::]:{free_port()}", "server": {"max_workers": 16}})
    handle = start(cfg, device=cpu_only())
    channels = []

    def channel(host: str = "127.0.0.1"):
        ch = grpc.insecure_channel(f"{host}:{handle.port}")
        channels.append(ch)
        return scheduler_pb2_grpc.SchedulerStub(ch)

    yield channel
    for ch in channels:
        ch.close()
    handle.stop(grace_ms=0)


def test_status_shows_no_lease_id(scheduler):
    stub = scheduler()
    held = _register(stub, "search-0", os.getpid())
    stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=held.lease.lease_id, search_depth=3), timeout=WAIT_S)
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    (service,) = status.services
    assert service.instance == "search-0" and service.lease.ttl_ms > 0 and service.assignment.generation >= 1
    assert service.last_load.search_depth == 3
    assert held.lease.lease_id.encode() not in status.SerializeToString()  # in no field at all


def test_a_live_lease_is_not_taken_over_by_another_pid(scheduler):
    stub = scheduler()
    held = _register(stub, "search-0", 100)
    watch = stub.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=held.lease.lease_id),
                                  timeout=WAIT_S * 2)
    assert next(watch).generation == 1
    instance = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S).services[0].instance  # public
    err = _error(lambda: _register(stub, instance, 999))
    assert err.code() == C.ALREADY_EXISTS and err.details().startswith("instance: 'search-0'")
    # The holder keeps its lease and its stream.
    renewed = stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=held.lease.lease_id), timeout=WAIT_S)
    assert renewed.lease.lease_id == held.lease.lease_id
    assert watch.is_active()
    watch.cancel()


def test_watch_streams_are_limited_per_lease_and_per_peer_host(scheduler):
    """16 workers: 12 watch slots, at most 6 from one peer host, 2 per lease. A
    client on 127.0.0.1 registering 10 instances gets 6 streams; a service on ::1
    still gets its own."""
    attacker = scheduler("127.0.0.1")
    leases = [_register(attacker, f"x-{i}", 1).lease.lease_id for i in range(10)]
    opened, refused = [], []
    for lease_id in leases:
        for _ in range(MAX_WATCHES_PER_LEASE + 1):
            call = attacker.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease_id),
                                             timeout=WAIT_S * 4)
            try:
                next(call)
                opened.append(call)
            except grpc.RpcError as exc:
                assert exc.code() == C.RESOURCE_EXHAUSTED, exc
                refused.append(exc.details())
    try:
        assert len(opened) == 6, len(opened)
        assert any("on this lease" in d for d in refused) and any("peer host" in d for d in refused), refused
        service = scheduler("[::1]")
        lease_id = _register(service, "search-0", os.getpid()).lease.lease_id
        watch = service.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease_id), timeout=WAIT_S)
        assert next(watch).lease_id == lease_id
        watch.cancel()
        # Without a lease id (Status shows none) no stream opens at all.
        err = _error(lambda: next(attacker.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id="guess"),
                                                            timeout=WAIT_S)))
        assert err.code() == C.NOT_FOUND
    finally:
        for call in opened:
            call.cancel()


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.0.0.7:5123") == "ipv4:10.0.0.7"
    assert peer_host("ipv6:%5B::1%5D:5123") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/s.sock") == "unix:/tmp/s.sock"

"""Applying the scheduler's assignments (issue 5, part 4): stream priorities
and fixed memory pools, with a real scheduler and a real search service on
loopback. On a CPU host no stream exists; the assignment is recorded."""
from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from conftest import loopback_config
from prometheus_client import REGISTRY
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc, search_pb2, search_pb2_grpc

from reward_service.session import ModelSession
from scheduler.main import start as start_scheduler
from search_service import server as search_server
from search_service.streams import StreamSet
from tandem import pools
from tandem.device import cpu_only
from tandem.gpu import cupy_module
from tandem.server import channel
from tandem.stream_priority import nearest_allowed

WAIT_S = 10.0


def _wait(predicate, timeout_s: float = WAIT_S):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


@contextlib.contextmanager
def scheduler_and_search(cfg):
    """A real scheduler (no GPU) and a real search service following it, on loopback:
    yields (search service, search stub, scheduler stub)."""
    sched = start_scheduler(cfg, device=cpu_only())
    service = search_server.start(cfg)
    ch = channel(cfg.search.address, cfg)
    sch = grpc.insecure_channel(cfg.scheduler.address)
    try:
        _wait(lambda: service.scheduler.current is not None)
        yield service, search_pb2_grpc.SearchServiceStub(ch), scheduler_pb2_grpc.SchedulerStub(sch)
    finally:
        ch.close()
        sch.close()
        service.stop()
        sched.stop(grace_ms=200)


def _status(sched_stub):
    return sched_stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)


def test_stream_set_maps_assignments_onto_held_priorities():
    streams = StreamSet([0, -5])
    assert streams.held == (0, -5) and not streams.on_gpu
    assert (streams.assigned_stream_priority, streams.active_stream_priority) == (0, 0)
    assert streams.assign(-5) == -5
    assert streams.assign(-3) == 0  # never more urgent than assigned: the next held level below
    assert (streams.assigned_stream_priority, streams.active_stream_priority) == (-3, 0)
    assert streams.assign(-7) == -5
    with streams.launching() as p:  # CPU host: nothing to switch, the stream priority is still reported
        assert p == -5
    assert streams.stream(-5) is None
    with pytest.raises(ValueError):
        StreamSet([])


def test_reward_and_search_map_an_assignment_onto_held_stream_priorities_alike():
    """Held (0, -5), assigned -3: both services pick 0, never more urgent than
    assigned (tandem.stream_priority.nearest_allowed), and agree on any other
    assignment too."""
    held = (0, -5)
    # The reward session's own mapping on the CPU: stand-ins for its sessions
    # bound to streams of 0 and -5, which only a GPU can build.
    reward = object.__new__(ModelSession)
    reward._runners = [SimpleNamespace(stream_priority=p) for p in held]
    search = StreamSet(held)
    assert reward.set_stream_priority(-3) == search.assign(-3) == 0
    assert reward.active_stream_priority == search.active_stream_priority == 0
    for assigned in (1, 0, -1, -4, -5, -6):
        assert reward.set_stream_priority(assigned) == search.assign(assigned) == nearest_allowed(assigned, held)
        assert reward.active_stream_priority == search.active_stream_priority


def test_pushed_assignment_changes_the_search_services_stream_priority():
    """Dynamic policy: an urgent search (late game, deadline missed) elevates the
    service; the scheduler pushes -5 and later searches launch at -5."""
    cfg = loopback_config(scheduler={"policy": "dynamic", "report_interval_ms": 20},
                          search={"backend": "cpu", "stream_priorities": [0, -5]})
    with scheduler_and_search(cfg) as (service, stub, sched_stub):
        servicer = service.servicer
        assert servicer.streams.active_stream_priority == 0
        # Deadline 1 ms as a cap on a large budget: the slack goes negative, urgency >= 2.5.
        request = search_pb2.SearchRequest(game="connect4", moves="4444", simulations=100_000, deadline_ms=1.0,
                                           phase=search_pb2.GAME_PHASE_LATE, seed=1)
        stub.Search(request, timeout=WAIT_S)
        _wait(lambda: servicer.streams.active_stream_priority == -5)
        assert servicer.streams.assigned_stream_priority == -5
        assert REGISTRY.get_sample_value("tandem_search_stream_priority_active") == -5
        (svc,) = _status(sched_stub).services
        assert svc.assignment.stream_priority == -5 and svc.urgency >= 2.0
        # A calm frame (early game, plenty of slack): back to the least priority.
        calm = search_pb2.SearchRequest(game="connect4", moves="4", simulations=16, deadline_ms=1000.0,
                                        phase=search_pb2.GAME_PHASE_EARLY, seed=2)
        stub.Search(calm, timeout=WAIT_S)
        _wait(lambda: servicer.streams.active_stream_priority == 0)


def test_search_registers_its_pool_with_the_scheduler():
    cfg = loopback_config(scheduler={"report_interval_ms": 20},
                          search={"backend": "cpu", "stream_priorities": [0, -2, -5], "memory_pool_bytes": 1 << 20})
    with scheduler_and_search(cfg) as (service, _, sched_stub):
        (svc,) = _status(sched_stub).services
        assert svc.assignment.memory_pool_bytes == 1 << 20  # the pool it asked for is granted
        assert service.servicer.streams.held == (0, -2, -5)
        assert REGISTRY.get_sample_value("tandem_search_pool_bytes", {"what": "limit"}) == 0  # no GPU: no pool


def test_allocation_failures_are_recognised_as_pool_exhaustion():
    with pytest.raises(MemoryError) as info:  # numpy refuses at once: far beyond any host
        np.empty(1 << 62, np.uint8)
    assert pools.is_out_of_memory(info.value)
    assert pools.is_out_of_memory(RuntimeError(
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer of size 1024"))
    assert not pools.is_out_of_memory(ValueError("shape mismatch"))


def test_mps_memory_limit_environment():
    assert pools.mps_memory_env(0) == {}
    assert pools.mps_memory_env(8 << 30) == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}
    assert pools.mps_memory_env(1) == {"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1M"}


def test_cupy_pool_limit_on_a_cpu_host_says_so():
    assert pools.limit_cupy_pool(None, 1 << 20).startswith("no GPU")
    assert pools.cupy_pool_use(None) == (0, 0)


@pytest.mark.gpu
def test_gpu_streams_have_their_priority_and_pool_limit_refuses():
    cupy = cupy_module()
    assert cupy is not None
    streams = StreamSet([0, -5], cupy)
    streams.assign(-5)
    with streams.launching():
        assert cupy.cuda.runtime.streamGetPriority(cupy.cuda.get_current_stream().ptr) == -5
    pools.limit_cupy_pool(cupy, 64 << 20)
    try:
        with pytest.raises(Exception) as info:
            cupy.empty(128 << 20, cupy.uint8)
        assert pools.is_out_of_memory(info.value)
    finally:
        pools.limit_cupy_pool(cupy, 0)


def test_the_scheduler_decides_with_the_weights_of_the_yaml():
    """raise_threshold 100 (from scheduler.urgency): the same urgent search elevates nothing."""
    cfg = loopback_config(scheduler={"policy": "dynamic", "report_interval_ms": 20,
                                     "urgency": {"raise_threshold": 100.0, "lower_threshold": 99.0}},
                          search={"backend": "cpu"})
    with scheduler_and_search(cfg) as (service, stub, sched_stub):
        request = search_pb2.SearchRequest(game="connect4", moves="4444", simulations=100_000, deadline_ms=1.0,
                                           phase=search_pb2.GAME_PHASE_LATE, seed=1)
        stub.Search(request, timeout=WAIT_S)
        _wait(lambda: _status(sched_stub).services[0].urgency >= 2.0)
        assert service.servicer.streams.active_stream_priority == 0

"""The scheduler daemon over real gRPC on loopback, and its client library."""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc, search_pb2

from scheduler.main import _DrainHook, log_findings, start
from scheduler.server import MAX_INSTANCE_CHARS
from tandem import device as device_mod
from tandem.config import TandemConfig
from tandem.device import NOMINAL_PRIORITY_RANGE, cpu_only, probe
from tandem.paths import REPO_ROOT
from tandem.scheduler_client import SchedulerClient
from tandem.stream_priority import stream_priority_range
from tandem.urgency_weights import DEFAULT_WEIGHTS

SEARCH = scheduler_pb2.SERVICE_KIND_SEARCH
REWARD = scheduler_pb2.SERVICE_KIND_REWARD
GRACE_MS = 60_000.0  # a grace period no stop that waited for it could hide on any machine
WAIT_S = 5.0  # upper bound for anything that should happen "at once"; tests never sleep this long


def make_cfg(address: str = "127.0.0.1:0", **scheduler_fields) -> TandemConfig:
    base = TandemConfig()
    return dataclasses.replace(
        base, scheduler=dataclasses.replace(base.scheduler, address=address, metrics_port=0, **scheduler_fields))


@pytest.fixture
def launch():
    """``launch(**scheduler_fields) -> (handle, stub)``; everything is stopped afterwards."""
    handles, channels = [], []

    def _launch(address: str = "127.0.0.1:0", **fields):
        handle = start(make_cfg(address, **fields), device=cpu_only())
        handles.append(handle)
        ch = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
        channels.append(ch)
        return handle, scheduler_pb2_grpc.SchedulerStub(ch)

    yield _launch
    for ch in channels:
        ch.close()
    for handle in handles:
        handle.stop(grace_ms=200)


def register(stub, instance="search-0", kind=SEARCH, address="127.0.0.1:50052", priorities=(0, -5),
             memory_bytes=0, pid=None):
    return stub.Register(scheduler_pb2.RegisterRequest(
        kind=kind, instance=instance, address=address, stream_priorities=list(priorities),
        memory_bytes=memory_bytes, pid=os.getpid() if pid is None else pid), timeout=WAIT_S)


class Watch:
    """Reads a WatchAssignments stream on a thread; items are (wall clock ms at receipt, Assignment)."""

    def __init__(self, stub, lease_id: str):
        self.call = stub.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease_id))
        self.items: queue.Queue = queue.Queue()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for a in self.call:
                self.items.put((time.time() * 1000.0, a))
            self.code, self.details = self.call.code(), self.call.details()
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details()
        self.ended.set()

    def next(self, timeout_s: float = WAIT_S) -> tuple[float, scheduler_pb2.Assignment]:
        return self.items.get(timeout=timeout_s)

    def wait_end(self, timeout_s: float = WAIT_S) -> grpc.StatusCode | None:
        assert self.ended.wait(timeout_s), "watch stream did not end"
        return self.code


def wait_until(predicate, timeout_s: float = WAIT_S, interval_s: float = 0.01):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError("condition not met in time")


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# -- register, watch, report -------------------------------------------------------------------


def test_register_then_watch_gets_the_assignment(launch):
    _, stub = launch(lease_ttl_ms=3000.0)
    response = register(stub, memory_bytes=1 << 20)
    assert response.lease.lease_id and response.lease.ttl_ms == 3000.0
    a = response.assignment
    assert (a.generation, a.lease_id, a.stream_priority, a.policy) == (1, response.lease.lease_id, 0, "default")
    assert a.memory_pool_bytes == 1 << 20 and a.active_thread_percentage == 100 and a.decided_unix_ms > 0
    watch = Watch(stub, response.lease.lease_id)
    _, first = watch.next()
    assert first == a
    watch.call.cancel()


def test_report_load_renews_the_lease(launch):
    # A ttl no stall of this process between two reports (every 50 ms) reaches on a busy machine.
    _, stub = launch(lease_ttl_ms=2000.0)
    lease = register(stub).lease
    end = time.monotonic() + 2.5  # past one ttl
    while time.monotonic() < end:
        renewed = stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=lease.lease_id, search_depth=3), timeout=WAIT_S)
        assert renewed.lease.lease_id == lease.lease_id
        time.sleep(0.05)
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert [s.instance for s in status.services] == ["search-0"]
    assert 0 < status.services[0].lease_expires_in_ms <= 2000.0
    assert status.services[0].last_load.search_depth == 3


def test_lease_expires_frees_memory_and_ends_the_watch(launch):
    _, stub = launch(lease_ttl_ms=200.0, gpu_memory_bytes=1000)
    first = register(stub, "search-0", memory_bytes=800)
    watch = Watch(stub, first.lease.lease_id)
    watch.next()
    err = rpc_error(lambda: register(stub, "reward-0", kind=REWARD, memory_bytes=300))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory_bytes" in err.details()
    assert watch.wait_end() == grpc.StatusCode.NOT_FOUND and "expired" in watch.details
    assert register(stub, "reward-0", kind=REWARD, memory_bytes=300).assignment.memory_pool_bytes == 300
    err = rpc_error(lambda: stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=first.lease.lease_id)))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "lease_id" in err.details()
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert [s.instance for s in status.services] == ["reward-0"]


def test_status_lists_services_and_device(launch):
    _, stub = launch(policy="static")
    register(stub, "search-0", SEARCH)
    reward = register(stub, "reward-0", REWARD, address="localhost:50051", priorities=())
    stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=reward.lease.lease_id, queue_age_ms=10.0, queue_depth=4))
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert status.policy == "static"
    assert (status.least_priority, status.greatest_priority) == (NOMINAL_PRIORITY_RANGE.least,
                                                                 NOMINAL_PRIORITY_RANGE.greatest)
    assert status.gpu == "" and not status.mps_active and not status.priorities_enforced
    assert "no GPU" in status.mps_message
    by_name = {s.instance: s for s in status.services}
    assert set(by_name) == {"search-0", "reward-0"}
    assert by_name["reward-0"].kind == REWARD and by_name["reward-0"].address == "localhost:50051"
    assert by_name["reward-0"].last_load.queue_depth == 4 and by_name["reward-0"].urgency > 0
    assert by_name["search-0"].assignment.active_thread_percentage == 50
    assert not by_name["search-0"].lease.lease_id and by_name["search-0"].lease_expires_in_ms > 0  # ids are secret
    assert not by_name["search-0"].assignment.lease_id and by_name["search-0"].lease.ttl_ms == 3000.0
    assert status.decisions == 2


def test_dynamic_pushes_the_greatest_priority_to_the_watcher(launch):
    _, stub = launch(policy="dynamic")
    lease = register(stub, priorities=(0, -5)).lease
    watch = Watch(stub, lease.lease_id)
    _, first = watch.next()
    assert first.stream_priority == 0
    sent_ms = time.time() * 1000.0
    stub.ReportLoad(scheduler_pb2.LoadReport(
        lease_id=lease.lease_id, phase=search_pb2.GAME_PHASE_LATE, search_depth=40, deadline_slack_ms=-2.0))
    received_ms, pushed = watch.next()
    assert (pushed.stream_priority, pushed.generation, pushed.policy) == (-5, 2, "dynamic")
    assert pushed.urgency >= 2.0
    # Measured, not asserted (timing depends on the machine): decision -> watcher, and report -> watcher.
    print(f"\ndecided -> at the watcher: {received_ms - pushed.decided_unix_ms:.3f} ms; "
          f"ReportLoad sent -> at the watcher: {received_ms - sent_ms:.3f} ms")
    # The same urgency again: nothing new is pushed; calm again: back to least.
    stub.ReportLoad(scheduler_pb2.LoadReport(
        lease_id=lease.lease_id, phase=search_pb2.GAME_PHASE_LATE, search_depth=40, deadline_slack_ms=-2.0))
    stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=lease.lease_id, phase=search_pb2.GAME_PHASE_EARLY))
    _, calm = watch.next()
    assert (calm.stream_priority, calm.generation) == (0, 3)
    assert watch.items.empty()
    watch.call.cancel()


def test_dynamic_lowers_the_bulk_share_while_frames_are_at_risk_and_gives_it_back(launch):
    """The lever over bulk work: a reward service reporting a critical p95 over
    the raise threshold has its bulk share halved on each of its reports
    (pushed to its watcher, shown in Status); calm again, it grows back."""
    _, stub = launch(policy="dynamic")
    search = register(stub, instance="search-0", kind=SEARCH).lease
    reward = register(stub, instance="reward-0", kind=REWARD, address="127.0.0.1:50051").lease
    watch = Watch(stub, reward.lease_id)
    assert watch.next()[1].bulk_share_percent == 100

    def report(critical_ms: float) -> None:
        stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=reward.lease_id, critical_latency_ms=critical_ms),
                        timeout=WAIT_S)

    report(5.0)
    report(5.0)
    first, second = watch.next()[1], watch.next()[1]
    assert (first.bulk_share_percent, second.bulk_share_percent) == (50, 25)
    assert first.frames_at_risk and second.frames_at_risk
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert status.frames_at_risk and status.bulk_share_changes == 2
    # A search's report re-reads the risk but never steps a reward service's share.
    stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=search.lease_id, deadline_slack_ms=3.0), timeout=WAIT_S)
    assert stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S).bulk_share_changes == 2
    report(0.1)
    calm = watch.next()[1]
    assert calm.bulk_share_percent == 25 + DEFAULT_WEIGHTS.bulk_increase_percent and not calm.frames_at_risk
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert not status.frames_at_risk and status.bulk_share_changes == 3
    row = {s.instance: s for s in status.services}["reward-0"]
    assert row.assignment.bulk_share_percent == calm.bulk_share_percent
    assert row.last_load.critical_latency_ms == pytest.approx(0.1)
    watch.call.cancel()


@pytest.mark.parametrize("policy_name, share", [("default", 100), ("static", DEFAULT_WEIGHTS.static_bulk_share_percent)])
def test_default_applies_no_bulk_lever_and_static_a_fixed_one(launch, policy_name, share):
    _, stub = launch(policy=policy_name)
    registered = register(stub, instance="reward-0", kind=REWARD, address="127.0.0.1:50051")
    assert registered.assignment.bulk_share_percent == share
    for _ in range(3):
        stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=registered.lease.lease_id, critical_latency_ms=50.0),
                        timeout=WAIT_S)
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert status.services[0].assignment.bulk_share_percent == share and status.bulk_share_changes == 0


# -- bad input ------------------------------------------------------------------------------------

GOOD = dict(kind=SEARCH, instance="search-0", address="127.0.0.1:50052", stream_priorities=[0, -5],
            memory_bytes=0, pid=1)
BAD_REGISTER = [
    (dict(kind=scheduler_pb2.SERVICE_KIND_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT, "kind"),
    (dict(kind=7), grpc.StatusCode.INVALID_ARGUMENT, "kind"),
    (dict(instance=""), grpc.StatusCode.INVALID_ARGUMENT, "instance"),
    (dict(instance="x" * (MAX_INSTANCE_CHARS + 1)), grpc.StatusCode.INVALID_ARGUMENT, "instance"),
    (dict(instance="a\nb"), grpc.StatusCode.INVALID_ARGUMENT, "instance"),
    (dict(stream_priorities=[0, 1]), grpc.StatusCode.INVALID_ARGUMENT, "stream_priorities[1]"),
    (dict(stream_priorities=[-6]), grpc.StatusCode.INVALID_ARGUMENT, "stream_priorities[0]"),
    (dict(address=""), grpc.StatusCode.INVALID_ARGUMENT, "address"),
    (dict(address="localhost"), grpc.StatusCode.INVALID_ARGUMENT, "address"),
    (dict(address=":50052"), grpc.StatusCode.INVALID_ARGUMENT, "address"),
    (dict(address="host:0"), grpc.StatusCode.INVALID_ARGUMENT, "address"),
    (dict(address="host:65536"), grpc.StatusCode.INVALID_ARGUMENT, "address"),
    (dict(address="host:http"), grpc.StatusCode.INVALID_ARGUMENT, "address"),
    (dict(memory_bytes=1001), grpc.StatusCode.RESOURCE_EXHAUSTED, "memory_bytes"),
]


@pytest.mark.parametrize("fields,code,field", BAD_REGISTER, ids=[f"{c[2]}-{i}" for i, c in enumerate(BAD_REGISTER)])
def test_bad_register_gets_its_status_naming_the_field(launch, fields, code, field):
    _, stub = launch(gpu_memory_bytes=1000)
    request = scheduler_pb2.RegisterRequest(**{**GOOD, **fields})
    err = rpc_error(lambda: stub.Register(request, timeout=WAIT_S))
    assert err.code() == code
    assert err.details().startswith(field), err.details()
    # The scheduler still answers, and the good request still works.
    assert stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S).policy == "default"
    assert register(stub, "ok-0").lease.lease_id


def test_ipv6_and_hostname_addresses_are_accepted(launch):
    _, stub = launch()
    assert register(stub, "a", address="[::1]:50052").lease.lease_id
    assert register(stub, "b", address="search.internal:50052").lease.lease_id


def test_a_live_lease_is_never_taken_over_and_lapses_to_a_restarted_process(launch):
    _, stub = launch(gpu_memory_bytes=1000, lease_ttl_ms=400.0)
    first = register(stub, "search-0", memory_bytes=600, pid=100)
    watch = Watch(stub, first.lease.lease_id)
    watch.next()
    for pid in (100, 101):  # the same process (a lost answer) or another one: the lease is the holder's
        err = rpc_error(lambda: register(stub, "search-0", memory_bytes=600, pid=pid))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS and err.details().startswith("instance")
    # The holder went (a restarted process has lost its lease id): once the lease has lapsed,
    # the instance registers again, and the old lease's memory is free.
    second = wait_until(lambda: _try_register(stub, "search-0", memory_bytes=600, pid=101))
    assert second.lease.lease_id != first.lease.lease_id
    assert watch.wait_end() == grpc.StatusCode.NOT_FOUND and "expired" in watch.details
    err = rpc_error(lambda: stub.ReportLoad(scheduler_pb2.LoadReport(lease_id=first.lease.lease_id)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    status = stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
    assert [s.instance for s in status.services] == ["search-0"]


def _try_register(stub, instance, **fields):
    try:
        return register(stub, instance, **fields)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.ALREADY_EXISTS
        return None


def test_a_cancelled_watch_frees_its_server_thread(launch):
    handle, stub = launch()
    leases = [register(stub, f"search-{i}").lease.lease_id for i in range(2)]
    watches = [Watch(stub, lease_id) for lease_id in (*leases, leases[0])]
    for w in watches:
        w.next()
    assert handle.servicer.open_watches == 3
    for w in watches:
        w.call.cancel()
    wait_until(lambda: handle.servicer.open_watches == 0)


def test_unknown_lease_is_not_found(launch):
    _, stub = launch()
    err = rpc_error(lambda: stub.ReportLoad(scheduler_pb2.LoadReport(lease_id="nope"), timeout=WAIT_S))
    assert err.code() == grpc.StatusCode.NOT_FOUND and err.details().startswith("lease_id")
    watch = Watch(stub, "nope")
    assert watch.wait_end() == grpc.StatusCode.NOT_FOUND and watch.details.startswith("lease_id")


_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=300)
_i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_u32 = st.integers(min_value=0, max_value=2**32 - 1)
_u64 = st.integers(min_value=0, max_value=2**64 - 1)
_f64 = st.floats(allow_nan=True, allow_infinity=True)


def _mostly(valid, anything):
    """Valid values three times out of four, so that fuzzed requests also get past validation."""
    return st.integers(0, 3).flatmap(lambda i: anything if i == 3 else valid)


_EXPECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def fuzz_target():
    handle = start(make_cfg(lease_ttl_ms=100.0, gpu_memory_bytes=1 << 30, policy="dynamic"), device=cpu_only())
    ch = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
    yield scheduler_pb2_grpc.SchedulerStub(ch)
    ch.close()
    handle.stop(grace_ms=200)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=_mostly(st.sampled_from([SEARCH, REWARD]), _i32),
       instance=_mostly(st.sampled_from(["fuzz-0", "fuzz-1", "fuzz-2"]), _text),
       address=_mostly(st.just("127.0.0.1:50052"), _text),
       priorities=_mostly(st.lists(st.integers(-5, 0), max_size=6), st.lists(_i32, max_size=80)),
       memory=_mostly(st.integers(0, 1 << 29), _u64), pid=_mostly(st.sampled_from([1, 2]), _u32),
       use_lease=st.booleans(), lease_text=_text, phase=_i32, depth=_u32, slack=_f64, age=_f64, qdepth=_u32,
       rps=_f64, used=_u64)
def test_scheduler_never_crashes_on_a_client_message(fuzz_target, kind, instance, address, priorities, memory, pid,
                                                     use_lease, lease_text, phase, depth, slack, age, qdepth, rps,
                                                     used):
    stub = fuzz_target
    lease_id = lease_text
    outcome = "OK"
    try:
        r = stub.Register(scheduler_pb2.RegisterRequest(
            kind=kind, instance=instance, address=address, stream_priorities=priorities, memory_bytes=memory,
            pid=pid), timeout=WAIT_S)
        if use_lease:
            lease_id = r.lease.lease_id
    except grpc.RpcError as exc:
        outcome = exc.code().name
        assert exc.code() in _EXPECTED, (exc.code(), exc.details())
    event(f"Register: {outcome}")
    try:
        stub.ReportLoad(scheduler_pb2.LoadReport(
            lease_id=lease_id, phase=phase, search_depth=depth, deadline_slack_ms=slack, queue_age_ms=age,
            queue_depth=qdepth, requests_per_s=rps, memory_used_bytes=used), timeout=WAIT_S)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, (exc.code(), exc.details())
    call = stub.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease_id), timeout=WAIT_S)
    try:
        first = next(call)
        assert first.lease_id == lease_id
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, (exc.code(), exc.details())
    finally:
        call.cancel()
    assert stub.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S).policy == "dynamic"


# -- shutdown -------------------------------------------------------------------------------------------


def test_stop_ends_open_watch_streams_at_once(launch):
    handle, stub = launch()
    watch = Watch(stub, register(stub).lease.lease_id)
    watch.next()
    began = time.monotonic()
    handle.stop(grace_ms=GRACE_MS)  # the open stream must not hold the stop up for the grace
    assert time.monotonic() - began < GRACE_MS / 1000.0 / 2  # far below it, on a machine however slow
    assert watch.wait_end() == grpc.StatusCode.UNAVAILABLE


def test_drain_hook_ends_watch_streams_when_not_serving(launch):
    handle, stub = launch()
    watch = Watch(stub, register(stub).lease.lease_id)
    watch.next()
    _DrainHook(handle).set_serving(False)
    assert watch.wait_end() == grpc.StatusCode.UNAVAILABLE
    err = rpc_error(lambda: register(stub, "late-0"))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


def test_serve_stops_on_sigterm_without_waiting_for_open_watch_streams(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = (
        "import dataclasses, logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from tandem.config import TandemConfig\n"
        "from scheduler.main import serve\n"
        "base = TandemConfig()\n"
        f"serve(dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, "
        f"address='127.0.0.1:{port}', metrics_port=0, "
        f"server=dataclasses.replace(base.scheduler.server, grace_period_ms={GRACE_MS}))))\n"
    )
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=log_file, stderr=log_file)
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(ch).result(timeout=WAIT_S * 2)
        stub = scheduler_pb2_grpc.SchedulerStub(ch)
        watch = Watch(stub, register(stub).lease.lease_id)
        watch.next()
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=GRACE_MS / 1000.0) == 0
        assert time.monotonic() - began < GRACE_MS / 1000.0 / 2  # the open stream did not hold it to the grace
        assert watch.wait_end() == grpc.StatusCode.UNAVAILABLE
        ch.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    assert any(words in output for words in ("are not enforced across processes", "act across processes",
                                             "stream priorities and MPS: not applicable without a GPU"))


# -- client library --------------------------------------------------------------------------------------


def test_client_follows_and_survives_a_scheduler_restart(launch):
    handle, _ = launch(policy="dynamic", lease_ttl_ms=1000.0)
    port = handle.port
    got: list[scheduler_pb2.Assignment] = []
    urgent = threading.Event()

    def load():
        if urgent.is_set():
            return {"phase": search_pb2.GAME_PHASE_LATE, "search_depth": 64, "deadline_slack_ms": -1.0,
                    "not_a_field": 1}
        return {"phase": search_pb2.GAME_PHASE_EARLY, "search_depth": 1}

    client = SchedulerClient(
        f"127.0.0.1:{port}", SEARCH, "search-0", "127.0.0.1:50052", stream_priorities=(0, -5),
        memory_bytes=1 << 20, load_fn=load, on_assignment=got.append, report_interval_ms=20.0,
        backoff_initial_ms=20.0, backoff_max_ms=200.0)
    client.start()
    try:
        first = client.wait_for_assignment(WAIT_S)
        assert first is not None and first.stream_priority == 0
        urgent.set()
        wait_until(lambda: client.current.stream_priority == -5)  # pushed through the watch stream
        assert got[-1].generation == 2 and got[-1] == client.current
        lease_before = client.lease_id

        handle.stop(grace_ms=200)
        time.sleep(0.2)  # several report intervals with the scheduler away
        assert client.current.stream_priority == -5 and client.current.lease_id == lease_before

        handle2, stub2 = launch(f"127.0.0.1:{port}", policy="dynamic", lease_ttl_ms=1000.0)
        assert handle2.port == port
        wait_until(lambda: client.lease_id not in (None, lease_before))
        status = stub2.Status(scheduler_pb2.StatusRequest(), timeout=WAIT_S)
        assert [s.instance for s in status.services] == ["search-0"]
        assert not status.services[0].lease.lease_id  # the holder's secret, not shown
        with handle2.servicer.table.lock:
            assert handle2.servicer.table.get(client.lease_id) is not None
        wait_until(lambda: client.current.lease_id == client.lease_id and client.current.stream_priority == -5)
        generations = [(a.lease_id, a.generation) for a in got]
        assert len(generations) == len(set(generations))  # each (lease, generation) delivered once
    finally:
        client.stop()
    assert client.current is not None  # kept after stop


def test_client_waits_for_a_scheduler_that_is_not_up_yet(launch):
    handle, _ = launch()
    port = handle.port
    handle.stop(grace_ms=0)
    errors = []
    client = SchedulerClient(f"127.0.0.1:{port}", REWARD, "reward-0", "127.0.0.1:50051",
                             load_fn=lambda: 1 / 0, on_assignment=lambda a: errors.append(a) or 1 / 0,
                             report_interval_ms=20.0, backoff_initial_ms=10.0, backoff_max_ms=100.0)
    client.start()
    try:
        time.sleep(0.1)
        assert client.current is None and client.lease_id is None
        launch(f"127.0.0.1:{port}")
        assert client.wait_for_assignment(WAIT_S) is not None  # on_assignment raising is only logged
        time.sleep(0.1)  # a few reports with a load_fn that raises
        assert client.lease_id is not None and len(errors) == 1
    finally:
        client.stop()


# -- device and start-up ---------------------------------------------------------------------------------


def test_probe_without_gpu_says_so_plainly(monkeypatch):
    monkeypatch.setattr(device_mod, "_probe_gpu", lambda: None)
    info = probe()
    assert not info.has_gpu and not info.priorities_enforced and not info.mps_active
    assert info.message == "no GPU: stream priorities are not enforced across processes"
    assert info.priority_range == NOMINAL_PRIORITY_RANGE == cpu_only().priority_range


def test_probe_with_gpu_but_no_mps(monkeypatch, tmp_path):
    monkeypatch.setattr(device_mod, "_probe_gpu", lambda: ("Fake GPU", 1 << 30, NOMINAL_PRIORITY_RANGE))
    monkeypatch.setattr(device_mod.shutil, "which", lambda name: None)
    info = probe(str(tmp_path))
    assert info.has_gpu and info.range_from_device and not info.priorities_enforced
    assert "not on PATH" in info.mps_message and "not enforced" in info.message


def test_probe_with_mps_daemon_answering(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text("#!/bin/sh\ncat >/dev/null\nexit 0\n")
    fake.chmod(0o755)
    (tmp_path / "control").write_text("")
    monkeypatch.setattr(device_mod, "_probe_gpu", lambda: ("Fake GPU", 1 << 30, NOMINAL_PRIORITY_RANGE))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    info = probe(str(tmp_path))
    assert info.mps_active and info.priorities_enforced and "answering" in info.mps_message


def test_priority_range_read_back_through_clamping():
    class FakeRuntime:  # CuPy 14 has no deviceGetStreamPriorityRange; CUDA clamps priorities
        streamNonBlocking = 1

        def __init__(self):
            self.streams = {}

        def streamCreateWithPriority(self, flags, priority):
            self.streams[len(self.streams) + 1] = min(max(priority, -5), 0)
            return len(self.streams)

        def streamGetPriority(self, stream):
            return self.streams[stream]

        def streamDestroy(self, stream):
            self.streams[stream] = None

    runtime = FakeRuntime()
    assert stream_priority_range(runtime) == (0, -5)
    assert all(v is None for v in runtime.streams.values())  # streams destroyed


def test_gpu_probe_runs_in_a_child_and_answers_plainly():
    found = device_mod._probe_gpu()
    assert found is None or (found[0] and found[1] > 0 and found[2].greatest <= found[2].least)


def test_findings_warn_when_a_gpu_s_priorities_are_not_enforced_and_not_on_a_cpu(caplog):
    gpu_without_mps = dataclasses.replace(cpu_only(), gpu_name="NVIDIA H200", message="MPS is not running")
    with caplog.at_level(logging.INFO, logger="scheduler"):
        log_findings(gpu_without_mps, "dynamic")
        log_findings(cpu_only(), "dynamic")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("stream priorities are not enforced across processes: "
                                                          "MPS is not running; policy 'dynamic'")
    assert any("no GPU" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    # Without a GPU: one line, no nominal priority range, no remedy.
    cpu_lines = [r.getMessage() for r in caplog.records][-1:]
    assert cpu_lines == ["no GPU: the models and the search run on the CPU; stream priorities and MPS: "
                         "not applicable without a GPU"]

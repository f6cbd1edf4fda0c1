"""The small library a service uses to follow the scheduler.

::

    client = SchedulerClient(
        cfg.scheduler.address, scheduler_pb2.SERVICE_KIND_SEARCH, "search-0",
        service_address=cfg.search.address, stream_priorities=(0, -5),
        memory_bytes=2 << 30, load_fn=lambda: {"phase": 3, "search_depth": 12},
        on_assignment=apply, report_interval_ms=cfg.scheduler.report_interval_ms, cfg=cfg)
    client.start()
    ...
    client.stop()

Behaviour
---------
* A background thread registers (retrying with exponential backoff while the
  scheduler is unavailable), then reports ``load_fn()`` at once and every
  ``report_interval_ms`` after -- each report renews the lease.
* A second thread per lease watches the assignment stream and calls
  ``on_assignment(assignment)`` for each new one (the first comes with the
  registration). Calls are serialised, in generation order, one per
  (lease, generation); after a re-registration the new lease's first
  assignment is delivered even when it equals the last.
* NOT_FOUND (lease expired or replaced) re-registers at once. UNAVAILABLE
  retries the same lease with backoff on a fresh channel; a scheduler that
  came back without the lease answers NOT_FOUND, and the client registers
  again. ALREADY_EXISTS (a registration whose answer was lost) waits for the
  old lease to lapse. Meanwhile :attr:`current` keeps the last assignment:
  the service runs on with it while the scheduler is away.
* Nothing raises into the service: failures are logged (a WARNING on the
  first failure of a run, DEBUG after) and retried; exceptions from
  ``load_fn`` or ``on_assignment`` are logged and ignored.

Concurrency: ``self._lock`` guards ``_lease_id``, ``_current``,
``_delivered`` (last (lease, generation) handed out), ``_channel``,
``_watch_call``, ``_watch_lease`` and ``_watch_thread``. ``_failing`` and the
backoff belong to the main background thread alone. ``self._deliver_lock`` serialises
``on_assignment`` calls; it is taken before ``self._lock``, never after.
"""
from __future__ import annotations

import logging
import os
import random
import threading
from typing import Any, Callable, Iterable

import grpc
from prometheus_client import Counter, Gauge

from tandem.config import TandemConfig
from tandem.server import channel as make_channel
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)

# This process's lease (one scheduler client per service process).
LEASE_HELD = Gauge("tandem_scheduler_client_lease_held", "1 while this service holds a scheduler lease, else 0.",
                   multiprocess_mode="livemin")  # under workers: 1 while every worker holds its own
LEASES_LOST = Counter("tandem_scheduler_client_leases_lost",
                      "Leases the scheduler no longer knew (expired or replaced); the service registers again.")
_LOAD_FIELDS = frozenset(f.name for f in scheduler_pb2.LoadReport.DESCRIPTOR.fields) - {"lease_id"}
# Codes after which the next attempt uses a fresh channel (skipping gRPC's own
# reconnect backoff, which would otherwise delay noticing a restarted scheduler).
_RECONNECT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class _Backoff:
    """Exponential backoff with ±20 % jitter, in seconds."""

    def __init__(self, initial_ms: float, max_ms: float):
        self._initial = initial_ms / 1000.0
        self._max = max(max_ms, initial_ms) / 1000.0
        self._next = self._initial

    def reset(self) -> None:
        self._next = self._initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2.0, self._max)
        return delay * random.uniform(0.8, 1.2)


class SchedulerClient:
    """Registers with the scheduler, reports load and follows assignments.

    Args:
        address: the scheduler's HOST:PORT.
        kind: ``scheduler_pb2.ServiceKind`` of this service.
        instance: unique name of this process, e.g. ``"search-0"``.
        service_address: HOST:PORT this service serves on.
        stream_priorities: CUDA stream priorities it holds streams for.
        memory_bytes: device memory it asks for (bytes; 0 = no pool).
        load_fn: returns a dict of ``LoadReport`` fields (``phase``,
            ``search_depth``, ``deadline_slack_ms``, ``queue_age_ms``,
            ``queue_depth``, ``requests_per_s``, ``memory_used_bytes``);
            None reports nothing but still renews the lease.
        on_assignment: called with each new ``Assignment`` (from the
            client's threads; keep it short).
        report_interval_ms: time between load reports (ms); keep it well
            under the scheduler's ``lease_ttl_ms``.
        cfg: for TLS and the auth token (``tandem.server.channel``).
        backoff_initial_ms, backoff_max_ms: retry delays while the scheduler
            is unreachable (ms).
        rpc_timeout_ms: deadline of Register and ReportLoad (ms).
        pid: sent with the registration; default ``os.getpid()``.

    Raises (at construction only -- a programming error, not a scheduler one):
        ValueError, TypeError: the arguments cannot form a RegisterRequest
            (e.g. a negative ``memory_bytes``).

    ``_stopping`` is a flag written by :meth:`stop` and read without a lock.
    """

    def __init__(
        self,
        address: str,
        kind: int,
        instance: str,
        service_address: str,
        stream_priorities: Iterable[int] = (),
        memory_bytes: int = 0,
        load_fn: Callable[[], dict[str, Any]] | None = None,
        on_assignment: Callable[[scheduler_pb2.Assignment], None] | None = None,
        report_interval_ms: float = 250.0,
        cfg: TandemConfig | None = None,
        *,
        backoff_initial_ms: float = 50.0,
        backoff_max_ms: float = 5000.0,
        rpc_timeout_ms: float = 2000.0,
        pid: int | None = None,
    ):
        self._address = address
        self._request = scheduler_pb2.RegisterRequest(
            kind=kind, instance=instance, address=service_address,
            stream_priorities=list(stream_priorities), memory_bytes=memory_bytes,
            pid=os.getpid() if pid is None else pid,
        )
        self._load_fn = load_fn
        self._on_assignment = on_assignment
        self._interval_s = report_interval_ms / 1000.0
        self._cfg = cfg
        self._backoff = _Backoff(backoff_initial_ms, backoff_max_ms)
        self._timeout_s = rpc_timeout_ms / 1000.0

        self._lock = threading.Lock()
        self._deliver_lock = threading.Lock()
        self._wake = threading.Event()  # stop, or the watch stream ended
        self._stopping = False
        self._lease_id: str | None = None
        self._current: scheduler_pb2.Assignment | None = None
        self._delivered: tuple[str, int] | None = None
        self._channel: grpc.Channel | None = None
        self._watch_call = None
        self._watch_lease: str | None = None
        self._watch_thread: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._failing = False  # a failure was logged at WARNING since the last success
        self._assigned = threading.Condition(self._lock)

    # -- public --------------------------------------------------------------------------------

    @property
    def current(self) -> scheduler_pb2.Assignment | None:
        """The last assignment received (kept while the scheduler is away), or None."""
        with self._lock:
            return self._current

    @property
    def lease_id(self) -> str | None:
        """The lease held now, or None while (re-)registering."""
        with self._lock:
            return self._lease_id

    def wait_for_assignment(self, timeout_s: float) -> scheduler_pb2.Assignment | None:
        """Blocks until a first assignment arrived or ``timeout_s`` passed; returns :attr:`current`."""
        with self._assigned:
            self._assigned.wait_for(lambda: self._current is not None, timeout_s)
            return self._current

    def start(self) -> None:
        """Starts the background thread (idempotent). Never raises for the scheduler's sake."""
        with self._lock:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(
                target=self._run, name=f"scheduler-client-{self._request.instance}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stops reporting and watching; the lease lapses after its ttl. Idempotent."""
        with self._lock:
            self._stopping = True
            thread, self._thread = self._thread, None
            call, watch_thread = self._watch_call, self._watch_thread
        self._wake.set()
        if call is not None:
            call.cancel()
        for t in (thread, watch_thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout_s)
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None

    # -- background thread ------------------------------------------------------------------------

    def _stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        with self._lock:
            if self._channel is None:
                self._channel = make_channel(self._address, self._cfg)
            return scheduler_pb2_grpc.SchedulerStub(self._channel)

    def _reset_channel(self) -> None:
        """Drops the channel so the next call connects afresh (no reconnect backoff)."""
        with self._lock:
            ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()

    def _failure(self, what: str, exc: grpc.RpcError | Exception) -> None:
        detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        log.log(level, "scheduler %s: %s failed (%s); will retry", self._address, what, detail)

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    def _run(self) -> None:
        while not self._stopping:
            try:
                delay = self._step()
            except Exception as exc:  # never let the thread die
                log.exception("scheduler client step failed")
                self._failure("step", exc)
                delay = self._backoff.next()
            if delay:
                self._sleep(delay)

    def _step(self) -> float:
        """One round: register if needed, else report. Returns the seconds to wait."""
        if self.lease_id is None:
            return self._register()
        delay = self._report()
        if not self._failing:
            self._ensure_watch()  # only after a report got through: no spinning on a dead server
        return delay

    def _register(self) -> float:
        try:
            response = self._stub().Register(self._request, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            if exc.code() in _RECONNECT:
                self._reset_channel()
            self._failure("Register", exc)
            return self._backoff.next()
        self._backoff.reset()
        if self._failing:
            log.info("scheduler %s: registered again as lease %s", self._address, response.lease.lease_id)
        self._failing = False
        with self._lock:
            self._lease_id = response.lease.lease_id
        LEASE_HELD.set(1)
        self._deliver(response.assignment)
        self._ensure_watch()
        return 0.0  # report at once: the scheduler learns this service's urgency without waiting

    def _report(self) -> float:
        lease_id = self.lease_id
        if lease_id is None:
            return 0.0
        report = scheduler_pb2.LoadReport(lease_id=lease_id)
        if self._load_fn is not None:
            try:
                fields = self._load_fn() or {}
                for name, value in fields.items():
                    if name in _LOAD_FIELDS:
                        setattr(report, name, value)
                    else:
                        log.debug("load_fn: ignoring unknown field %r", name)
            except Exception:
                log.exception("load_fn failed; reporting without load")
                report = scheduler_pb2.LoadReport(lease_id=lease_id)
        try:
            self._stub().ReportLoad(report, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            self._failure("ReportLoad", exc)
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                self._drop_lease(lease_id)
                self._backoff.reset()
                return 0.0
            if exc.code() in _RECONNECT:
                self._reset_channel()
            return self._backoff.next()
        self._backoff.reset()
        self._failing = False
        return self._interval_s

    def _drop_lease(self, lease_id: str) -> None:
        """Forgets ``lease_id`` (if still held) and ends its watch; keeps :attr:`current`."""
        with self._lock:
            if self._lease_id != lease_id:
                return
            self._lease_id = None
            call = self._watch_call
        LEASE_HELD.set(0)
        LEASES_LOST.inc()
        if call is not None:
            call.cancel()

    # -- watch thread -------------------------------------------------------------------------------

    def _ensure_watch(self) -> None:
        """Starts a watch stream for the held lease unless one is running."""
        with self._lock:
            if self._stopping or self._lease_id is None:
                return
            lease_id = self._lease_id
            if self._watch_thread is not None and self._watch_thread.is_alive():
                if self._watch_lease == lease_id:
                    return
                self._watch_call.cancel()  # a stream of a lease we no longer hold
            if self._channel is None:
                self._channel = make_channel(self._address, self._cfg)
            stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
            call = stub.WatchAssignments(scheduler_pb2.WatchAssignmentsRequest(lease_id=lease_id))
            self._watch_call, self._watch_lease = call, lease_id
            self._watch_thread = threading.Thread(
                target=self._watch, args=(lease_id, call), daemon=True,
                name=f"scheduler-watch-{self._request.instance}")
            self._watch_thread.start()

    def _watch(self, lease_id: str, call) -> None:
        try:
            for assignment in call:
                self._deliver(assignment)
            code, details = call.code(), call.details()
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        except Exception:  # e.g. the channel closed under us
            log.exception("watch stream failed")
            code, details = grpc.StatusCode.UNKNOWN, "watch stream failed"
        if self._stopping:
            return
        log.debug("watch of lease %s ended: %s %s", lease_id, code, details)
        if code == grpc.StatusCode.NOT_FOUND:
            self._drop_lease(lease_id)
            self._wake.set()  # re-register now
        # Any other end: the next report (one interval on) finds out whether the
        # scheduler is there and, if so, opens a new stream -- restarts are rate-limited.

    def _deliver(self, assignment: scheduler_pb2.Assignment) -> None:
        """Hands a new assignment to the service, once per (lease, generation), in order."""
        with self._deliver_lock:
            with self._lock:
                if assignment.lease_id != self._lease_id:
                    return  # from a lease we no longer hold
                key = (assignment.lease_id, assignment.generation)
                if self._delivered is not None and self._delivered[0] == key[0] and self._delivered[1] >= key[1]:
                    return
                self._delivered = key
                self._current = assignment
                self._assigned.notify_all()
            if self._on_assignment is not None:
                try:
                    self._on_assignment(assignment)
                except Exception:
                    log.exception("on_assignment failed for generation %d", assignment.generation)

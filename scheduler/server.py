"""The gRPC servicer of ``tandem.v1.Scheduler``.

Each RPC validates its request, then -- under the lease table's lock -- changes
the table, re-runs the policy (:mod:`scheduler.policy`) over every live
service, and pushes each changed assignment to that service's watch streams.
A push only appends to a watcher's queue and notifies its condition, so an
assignment reaches the stream's thread as soon as it is decided (no polling).

Concurrency invariants
----------------------
* ``self._table.lock`` guards the lease table, every ``LeaseEntry``'s mutable
  fields, ``self._decisions``, ``self._watch_count`` and ``self._closed``.
  Prometheus metrics are updated under it too, so they agree with the table.
* Watch streams block on their own :class:`~scheduler.leases.Watcher`
  condition, never on the table lock; lock order is table lock, then watcher.
* A watch stream ends when its lease expires or is replaced (NOT_FOUND), when
  the client goes away (``context.add_callback``), or when :meth:`close` runs
  at shutdown (UNAVAILABLE), so it never holds up ``server.stop``.
* No client message can take the scheduler down: requests are validated
  (INVALID_ARGUMENT naming the field), load reports are sanitised rather
  than refused (see :func:`scheduler.policy.urgency`), and echoed client
  text is cut short (``tests/scheduler/test_scheduler.py`` fuzzes every field).
* A lease is its holder's: the lease id is a secret that only Register's
  answer carries (``Status`` shows none), a live lease is never taken over by
  another Register, and watch streams are limited per lease and per peer host
  (``tests/scheduler/test_lease_ownership.py``).
"""
from __future__ import annotations

import logging
import re
import time
from typing import Callable, Iterator
from urllib.parse import unquote

import grpc
from prometheus_client import Counter, Gauge
from tandem.v1 import scheduler_pb2, scheduler_pb2_grpc

from scheduler import policy
from scheduler.leases import (
    AlreadyExists,
    Exhausted,
    LeaseEntry,
    LeaseTable,
    Reaper,
    WatchClosed,
    Watcher,
)
from tandem.config import SchedulerConfig
from tandem.device import DeviceInfo
from tandem.errors import quote
from tandem.stream_priority import PriorityRange
from tandem.urgency_weights import DEFAULT_WEIGHTS, UrgencyWeights

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name

MAX_INSTANCE_CHARS = 128
MAX_ADDRESS_CHARS = 256
MAX_STREAM_PRIORITIES = 64
MAX_LEASES = 1024
#: Watch streams each hold a server thread (sync gRPC); keep this many threads
#: free for unary RPCs however many streams are open.
RESERVED_UNARY_WORKERS = 4
#: Watch streams one lease may hold at once (a client replacing its stream
#: briefly holds two).
MAX_WATCHES_PER_LEASE = 2
#: A blocked watch stream re-checks that its RPC is alive this often (s). A
#: safety net only: pushes, expiry, cancellation and shutdown all wake it at once.
WATCH_LIVENESS_CHECK_S = 1.0

SERVICES_REGISTERED = Gauge("tandem_scheduler_services", "Services holding a live lease.")
# ``service_instance``, not ``instance``: Prometheus gives every scraped series an ``instance`` label (the target).
ASSIGNED_PRIORITY = Gauge(
    "tandem_scheduler_stream_priority", "CUDA stream priority assigned to a service instance.", ["service_instance"]
)
URGENCY = Gauge("tandem_scheduler_urgency", "Latest urgency of a service instance.", ["service_instance"])
MPS_ACTIVE = Gauge("tandem_scheduler_mps_active", "1 when an MPS control daemon answers for the GPU, else 0.")
DECISIONS = Counter("tandem_scheduler_decisions", "Assignments issued (every new generation).")
BULK_SHARE = Gauge("tandem_scheduler_bulk_share_ratio",
                   "Share of wall time (0-1) a reward service's bulk lanes may run batches.", ["service_instance"])
BULK_CHANGES = Counter("tandem_scheduler_bulk_share_changes", "Changes of a bulk share, by direction.",
                       ["direction"])
FRAMES_AT_RISK = Gauge("tandem_scheduler_frames_at_risk", "1 while the dynamic policy sees frames at risk.")

_KINDS = {scheduler_pb2.SERVICE_KIND_SEARCH, scheduler_pb2.SERVICE_KIND_REWARD}
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+)$")


class InvalidArgument(ValueError):
    """A request field is wrong; the message starts with the field's name."""


_short = quote  # client-supplied text in error messages, cut short


def check_address(address: str, field: str = "address") -> None:
    """Raises :class:`InvalidArgument` unless ``address`` is HOST:PORT (port 1..65535)."""
    if len(address) > MAX_ADDRESS_CHARS:
        raise InvalidArgument(f"{field}: longer than {MAX_ADDRESS_CHARS} characters")
    host, sep, port = address.rpartition(":")
    if not sep or not _HOST.match(host) or not port.isascii() or not port.isdigit() \
            or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{field}: expected HOST:PORT, got {_short(address)}")


def check_register(request: scheduler_pb2.RegisterRequest, prange: PriorityRange) -> None:
    """Validates a RegisterRequest against the device's priority range.

    Raises:
        InvalidArgument: the message names the field (kind, instance, address,
            stream_priorities[i]).
    """
    if request.kind not in _KINDS:
        if request.kind == scheduler_pb2.SERVICE_KIND_UNSPECIFIED:
            raise InvalidArgument("kind: must be SERVICE_KIND_SEARCH or SERVICE_KIND_REWARD, got unspecified")
        raise InvalidArgument(f"kind: unknown service kind {request.kind}")
    if not request.instance:
        raise InvalidArgument("instance: must not be empty")
    if len(request.instance) > MAX_INSTANCE_CHARS:
        raise InvalidArgument(f"instance: longer than {MAX_INSTANCE_CHARS} characters")
    if not request.instance.isprintable():
        raise InvalidArgument(f"instance: must be printable text, got {_short(request.instance)}")
    check_address(request.address)
    if len(request.stream_priorities) > MAX_STREAM_PRIORITIES:
        raise InvalidArgument(f"stream_priorities: more than {MAX_STREAM_PRIORITIES} entries")
    for i, p in enumerate(request.stream_priorities):
        if not prange.contains(p):
            raise InvalidArgument(
                f"stream_priorities[{i}]: {p} is outside the device's range "
                f"[{prange.greatest}, {prange.least}] (greatest, least)"
            )


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Leases, urgency and assignments for the services on one GPU.

    Args:
        cfg: ``policy``, ``lease_ttl_ms``, ``gpu_memory_bytes`` (0: the
            device's total; unlimited without a GPU) and ``server.max_workers``.
        device: what :func:`tandem.device.probe` found.
        weights: urgency and policy tunables.
        wall_ms: wall clock in ms (for ``Assignment.decided_unix_ms``).

    Call :meth:`close` before stopping the server; it ends every watch stream
    and the reaper thread.
    """

    def __init__(self, cfg: SchedulerConfig, device: DeviceInfo,
                 weights: UrgencyWeights = DEFAULT_WEIGHTS,
                 wall_ms: Callable[[], float] = lambda: time.time() * 1000.0):
        if cfg.policy not in policy.POLICIES:
            raise ValueError(f"scheduler.policy: must be one of {', '.join(policy.POLICIES)}, got {cfg.policy!r}")
        self._policy = cfg.policy
        self._device = device
        MPS_ACTIVE.set(1 if device.mps_active else 0)
        self._prange = device.priority_range
        self._weights = weights
        self._wall_ms = wall_ms
        capacity = cfg.gpu_memory_bytes or device.total_memory_bytes
        self._table = LeaseTable(cfg.lease_ttl_ms, capacity, MAX_LEASES)
        self._max_watches = max(1, cfg.server.max_workers - RESERVED_UNARY_WORKERS)
        # No one peer host may take more than half of the slots (but always two: a service's
        # stream and its replacement).
        self._max_watches_per_peer = max(2, self._max_watches // 2)
        self._watch_count = 0
        self._watches_by_peer: dict[str, int] = {}  # guarded by the table lock
        self._decisions = 0
        self._bulk_changes = 0
        self._at_risk = False  # guarded by the table lock: policy.frames_at_risk's last answer
        self._closed = False
        self._reaper = Reaper(self._table, self._on_expired)
        self._reaper.start()
        SERVICES_REGISTERED.set(0)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def table(self) -> LeaseTable:
        """The lease table (hold ``table.lock`` to read it)."""
        return self._table

    @property
    def open_watches(self) -> int:
        """WatchAssignments streams open now (each holds a server thread)."""
        with self._table.lock:
            return self._watch_count

    def close(self) -> None:
        """Ends every watch stream with UNAVAILABLE and stops the reaper. Idempotent."""
        with self._table.lock:
            self._closed = True
            for entry in self._table.entries():
                self._close_watchers(entry, "UNAVAILABLE", "the scheduler is shutting down")
        self._reaper.stop()

    # -- RPCs --------------------------------------------------------------------------------

    def Register(self, request, context):
        try:
            check_register(request, self._prange)
        except InvalidArgument as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        with self._table.lock:
            if self._closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
            self._expire_due()
            try:
                entry, replaced = self._table.add(
                    request.kind, request.instance, request.address, request.pid,
                    tuple(request.stream_priorities), request.memory_bytes,
                )
            except AlreadyExists as exc:
                context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
            except Exhausted as exc:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            if replaced is not None:  # had expired, not reaped yet
                self._forget(replaced, f"lease replaced: instance {_short(replaced.instance)} registered again")
                log.info("instance %s registered again after its lease expired (pid %d -> %d)",
                         entry.instance, replaced.pid, entry.pid)
            entry.urgency = policy.urgency(entry.kind, None, self._weights)
            if entry.kind == policy.REWARD:
                entry.bulk_share_percent = policy.next_bulk_share(self._policy, 100, False, self._weights)
            self._redecide()
            SERVICES_REGISTERED.set(len(self._table))
            log.info("registered %s (%s, pid %d, %d bytes) as lease %s",
                     entry.instance, scheduler_pb2.ServiceKind.Name(entry.kind), entry.pid,
                     entry.memory_bytes, entry.lease_id)
            return scheduler_pb2.RegisterResponse(lease=self._lease_pb(entry), assignment=entry.assignment)

    def WatchAssignments(self, request, context) -> Iterator[scheduler_pb2.Assignment]:
        watcher = Watcher()
        peer = peer_host(context.peer())
        with self._table.lock:
            entry = self._table.get(request.lease_id)
            if entry is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"lease_id: unknown or expired lease {_short(request.lease_id)}")
            if self._closed:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
            if len(entry.watchers) >= MAX_WATCHES_PER_LEASE:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"lease_id: {len(entry.watchers)} watch streams are open on this lease, "
                              f"the most one lease may hold")
            if self._watches_by_peer.get(peer, 0) >= self._max_watches_per_peer:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"lease_id: {self._watches_by_peer[peer]} watch streams are open from {_short(peer)}, "
                              f"the most one peer host may hold")
            if self._watch_count >= self._max_watches:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"lease_id: {self._watch_count} watch streams are open, the most this scheduler serves")
            self._watch_count += 1
            self._watches_by_peer[peer] = self._watches_by_peer.get(peer, 0) + 1
            entry.watchers.append(watcher)
            watcher.push(entry.assignment)  # the current assignment, at once
        if not context.add_callback(lambda: watcher.close("CANCELLED", "the client went away")):
            watcher.close("CANCELLED", "the client went away")
        try:
            while True:
                try:
                    assignment = watcher.next(WATCH_LIVENESS_CHECK_S)
                except WatchClosed as closed:
                    if closed.code != "CANCELLED":
                        context.set_code(getattr(grpc.StatusCode, closed.code))
                        context.set_details(closed.message)
                    return
                if assignment is not None:
                    yield assignment
                elif not context.is_active():
                    return
        finally:
            with self._table.lock:
                self._watch_count -= 1
                left = self._watches_by_peer.pop(peer) - 1
                if left:
                    self._watches_by_peer[peer] = left
                if watcher in entry.watchers:
                    entry.watchers.remove(watcher)

    def ReportLoad(self, request, context):
        with self._table.lock:
            entry = self._table.get(request.lease_id)
            if entry is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"lease_id: unknown or expired lease {_short(request.lease_id)}")
            self._table.renew(entry)
            load = scheduler_pb2.LoadReport()
            load.CopyFrom(request)
            entry.last_load = load
            entry.urgency = policy.urgency(entry.kind, load, self._weights)
            URGENCY.labels(entry.instance).set(entry.urgency)
            self._step_bulk_lever(entry)
            self._redecide()
            return scheduler_pb2.ReportLoadResponse(lease=self._lease_pb(entry))

    def Status(self, request, context):
        with self._table.lock:
            self._expire_due()
            services = [
                scheduler_pb2.ServiceStatus(
                    kind=e.kind,
                    instance=e.instance,
                    address=e.address,
                    lease=scheduler_pb2.Lease(ttl_ms=self._table.ttl_ms),  # the id is the holder's secret
                    assignment=_without_lease_id(e.assignment),
                    last_load=_without_lease_id(e.last_load),
                    lease_expires_in_ms=self._table.expires_in_ms(e),
                    urgency=e.urgency,
                )
                for e in self._table.entries()
            ]
            decisions, at_risk, bulk_changes = self._decisions, self._at_risk, self._bulk_changes
        device = self._device
        return scheduler_pb2.StatusResponse(
            policy=self._policy,
            mps_active=device.mps_active,
            mps_message=device.mps_message,
            priorities_enforced=device.priorities_enforced,
            services=services,
            least_priority=self._prange.least,
            greatest_priority=self._prange.greatest,
            gpu=device.gpu_name,
            decisions=decisions,
            frames_at_risk=at_risk,
            bulk_share_changes=bulk_changes,
        )

    # -- helpers (table lock held) -------------------------------------------------------------

    def _lease_pb(self, entry: LeaseEntry) -> scheduler_pb2.Lease:
        return scheduler_pb2.Lease(lease_id=entry.lease_id, ttl_ms=self._table.ttl_ms)

    def _step_bulk_lever(self, reporter: LeaseEntry) -> None:
        """Re-reads the risk from every live report; on a reward service's own
        report, steps its bulk share once (policy.next_bulk_share)."""
        loads = [(e.kind, e.last_load) for e in self._table.entries() if self._table.get(e.lease_id) is not None]
        was = self._at_risk
        self._at_risk = policy.frames_at_risk(loads, was, self._weights)
        FRAMES_AT_RISK.set(int(self._at_risk))
        if self._at_risk != was:
            slack = min([l.deadline_slack_ms for k, l in loads if k == policy.SEARCH and l and l.deadline_slack_ms]
                        or [0.0])
            acts = "" if self._policy == "dynamic" else f"; policy {self._policy} leaves the bulk share as it is"
            log.info("frames %s (reward services' critical queue + model p95: %s ms; searches' worst deadline "
                     "slack %.2f ms, 0: none reported)%s", "at risk" if self._at_risk else "safe again",
                     ", ".join(f"{l.critical_latency_ms:.2f}" for k, l in loads if k == policy.REWARD and l) or "none",
                     slack, acts)
        if reporter.kind != policy.REWARD:
            return
        old = reporter.bulk_share_percent
        new = policy.next_bulk_share(self._policy, old, self._at_risk, self._weights)
        if new != old:
            reporter.bulk_share_percent = new
            self._bulk_changes += 1
            BULK_CHANGES.labels("down" if new < old else "up").inc()
            log.info("%s: bulk share %d%% -> %d%% (frames %s, critical p95 %.2f ms)", reporter.instance, old, new,
                     "at risk" if self._at_risk else "safe", reporter.last_load.critical_latency_ms)

    def _redecide(self) -> None:
        """Re-runs the policy over every live lease; issues and pushes changed assignments."""
        entries = [e for e in self._table.entries() if self._table.get(e.lease_id) is not None]
        inputs = [
            policy.ServiceInput(e.lease_id, e.kind, e.urgency, e.stream_priorities, e.elevated, e.on_top)
            for e in entries
        ]
        decisions = policy.decide(self._policy, inputs, self._prange, self._weights)
        for entry in entries:
            d = decisions[entry.lease_id]
            entry.elevated, entry.on_top = d.elevated, d.on_top
            pool, bulk = entry.memory_bytes, entry.bulk_share_percent
            last = entry.assignment
            if last is not None and (last.stream_priority, last.active_thread_percentage, last.memory_pool_bytes,
                                     last.bulk_share_percent) == (d.stream_priority, d.active_thread_percentage,
                                                                  pool, bulk):
                continue
            entry.generation += 1
            entry.assignment = scheduler_pb2.Assignment(
                generation=entry.generation,
                lease_id=entry.lease_id,
                stream_priority=d.stream_priority,
                memory_pool_bytes=pool,
                policy=self._policy,
                active_thread_percentage=d.active_thread_percentage,
                decided_unix_ms=self._wall_ms(),
                urgency=entry.urgency,
                bulk_share_percent=bulk,
                frames_at_risk=self._at_risk,
            )
            self._decisions += 1
            DECISIONS.inc()
            ASSIGNED_PRIORITY.labels(entry.instance).set(d.stream_priority)
            URGENCY.labels(entry.instance).set(entry.urgency)
            if entry.kind == policy.REWARD:
                BULK_SHARE.labels(entry.instance).set(bulk / 100.0)
            for watcher in entry.watchers:
                watcher.push(entry.assignment)
            if last is not None:
                log.info("%s: stream priority %d -> %d, threads %d%%, bulk share %d%% (urgency %.2f, generation %d)",
                         entry.instance, last.stream_priority, d.stream_priority,
                         d.active_thread_percentage, bulk, entry.urgency, entry.generation)

    def _close_watchers(self, entry: LeaseEntry, code: str, message: str) -> None:
        for watcher in entry.watchers:
            watcher.close(code, message)

    def _forget(self, entry: LeaseEntry, why: str) -> None:
        """Ends ``entry``'s watch streams with NOT_FOUND and drops its metrics (already removed)."""
        self._close_watchers(entry, "NOT_FOUND", why)
        for gauge in (ASSIGNED_PRIORITY, URGENCY, BULK_SHARE):
            try:
                gauge.remove(entry.instance)
            except KeyError:
                pass

    def _on_expired(self, entries: list[LeaseEntry]) -> None:
        """Reaper callback: the entries are already out of the table."""
        for entry in entries:
            log.warning("lease of %s (%s) expired: no report for %.0f ms; %d bytes freed",
                        entry.instance, entry.lease_id, self._table.ttl_ms, entry.memory_bytes)
            self._forget(entry, f"lease_id: lease {entry.lease_id} expired")
        SERVICES_REGISTERED.set(len(self._table))
        self._redecide()

    def _expire_due(self) -> None:
        expired = self._table.pop_expired()
        if expired:
            self._on_expired(expired)


def _without_lease_id(message):
    """A copy of ``message`` (an Assignment or a LoadReport, or None) for
    ``Status``, whose readers must not learn the lease id."""
    if message is None:
        return None
    public = type(message)()
    public.CopyFrom(message)
    public.lease_id = ""
    return public


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer ("ipv4:10.0.0.7:5123" -> "ipv4:10.0.0.7",
    "ipv6:[::1]:5123" -> "ipv6:[::1]"; "unix:/path" as it is): the unit of
    the per-peer limits."""
    scheme, _, rest = unquote(peer).partition(":")  # gRPC writes "ipv6:%5B::1%5D:5123"
    if scheme in ("ipv4", "ipv6"):
        return f"{scheme}:{rest.rpartition(':')[0]}"
    return peer


def add_to_server(servicer: SchedulerServicer) -> Callable[[grpc.Server], str]:
    """A ``register`` function for :func:`tandem.server.build_server`."""

    def register(server: grpc.Server) -> str:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
        return SERVICE_NAME

    return register

"""The lease table: who is registered, until when, and with how much memory.

Concurrency invariants
----------------------
* ``LeaseTable.lock`` (a plain ``threading.Lock``) guards the table's maps,
  the memory accounting, and every mutable field of every :class:`LeaseEntry`
  it holds (``expires_at``, ``last_load``, ``urgency``, ``assignment``,
  ``generation``, the policy state, ``watchers``). Every ``LeaseTable``
  method except :meth:`LeaseTable.__init__` must be called with ``lock``
  held; the servicer takes it once per RPC so that "change the table, re-run
  the policy, push assignments" is one atomic step.
* Each :class:`Watcher` has its own ``threading.Condition`` guarding its queue
  and its ``closed`` state. Lock order: table lock, then a watcher's
  condition -- never the reverse. A watch stream waits on its watcher's
  condition without holding the table lock.
* The :class:`Reaper` thread takes the table lock to expire leases; it sleeps
  (without the lock) until the earliest expiry or until :meth:`LeaseTable.add`
  sets ``wakeup``.

Times are ``time.monotonic()`` seconds internally; durations at the API are ms.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import secrets
from dataclasses import dataclass, field
from typing import Callable

from tandem.v1 import scheduler_pb2

from tandem.errors import quote

log = logging.getLogger(__name__)

#: Assignments a slow watch stream may have pending before the oldest are
#: dropped (a newer generation replaces an older one, so only the latest matters).
WATCH_QUEUE_LIMIT = 64


class AlreadyExists(Exception):
    """The instance holds a live lease (whatever the pid: a lease belongs to
    whoever registered it, and only lapses or is given up by its holder)."""


class Exhausted(Exception):
    """Not enough memory (or lease slots) left for a new lease."""


class WatchClosed(Exception):
    """A watch stream must end: ``code`` (a ``grpc.StatusCode`` name) and ``message`` say why."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Watcher:
    """Mailbox of one WatchAssignments stream.

    ``push`` and ``close`` are called by the servicer (under the table lock);
    ``next`` by the stream's own thread (without it). ``_cond`` guards
    ``_queue`` and ``_closed``.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[scheduler_pb2.Assignment] = collections.deque(maxlen=WATCH_QUEUE_LIMIT)
        self._closed: WatchClosed | None = None

    def push(self, assignment: scheduler_pb2.Assignment) -> None:
        with self._cond:
            if self._closed is None:
                self._queue.append(assignment)
                self._cond.notify_all()

    def close(self, code: str = "CANCELLED", message: str = "watch ended") -> None:
        """Ends the stream after what is queued; the first reason given wins."""
        with self._cond:
            if self._closed is None:
                self._closed = WatchClosed(code, message)
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed is not None

    def next(self, timeout_s: float | None = None) -> scheduler_pb2.Assignment | None:
        """The next assignment; None after ``timeout_s`` without one.

        Raises:
            WatchClosed: the watcher was closed and its queue is empty.
        """
        with self._cond:
            if not self._queue and self._closed is None:
                self._cond.wait(timeout_s)
            if self._queue:
                return self._queue.popleft()
            if self._closed is not None:
                raise self._closed
            return None


@dataclass(eq=False)
class LeaseEntry:
    """One registered service. Mutable fields: guarded by the table's lock."""

    lease_id: str
    kind: int
    instance: str
    address: str
    pid: int
    stream_priorities: tuple[int, ...]
    memory_bytes: int
    expires_at: float  # monotonic seconds
    last_load: scheduler_pb2.LoadReport | None = None
    urgency: float = 0.0
    assignment: scheduler_pb2.Assignment | None = None
    generation: int = 0
    elevated: bool = False  # policy state fed back to the next decision
    on_top: bool = False
    bulk_share_percent: int = 100  # reward services: the lever over bulk work (policy.next_bulk_share)
    watchers: list[Watcher] = field(default_factory=list)


class LeaseTable:
    """Live leases by id and by instance, with a fixed memory budget.

    Args:
        ttl_ms: lease lifetime after registration or the last renewal (ms).
        capacity_bytes: memory that may be handed out in total; 0 = unlimited.
        max_leases: more live leases than this: :class:`Exhausted`.
        clock: monotonic clock in seconds (tests may inject one).
    """

    def __init__(self, ttl_ms: float, capacity_bytes: int = 0, max_leases: int = 1024,
                 clock: Callable[[], float] = time.monotonic):
        self.lock = threading.Lock()
        self.wakeup = threading.Event()  # set when a lease is added (for the reaper)
        self.ttl_ms = float(ttl_ms)
        self.capacity_bytes = int(capacity_bytes)
        self.max_leases = max_leases
        self.clock = clock
        self._by_id: dict[str, LeaseEntry] = {}
        self._by_instance: dict[str, LeaseEntry] = {}
        self._used_bytes = 0

    # -- queries (lock held) ------------------------------------------------------------

    def get(self, lease_id: str) -> LeaseEntry | None:
        """The live lease ``lease_id``; None if unknown or past its expiry (even if not reaped yet)."""
        entry = self._by_id.get(lease_id)
        if entry is None or entry.expires_at <= self.clock():
            return None
        return entry

    def entries(self) -> list[LeaseEntry]:
        """All leases not yet reaped, in registration order."""
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def memory_left(self, freed_bytes: int = 0) -> int | None:
        """Bytes still available (plus ``freed_bytes`` about to be released); None = unlimited."""
        if self.capacity_bytes <= 0:
            return None
        return self.capacity_bytes - self._used_bytes + freed_bytes

    def expires_in_ms(self, entry: LeaseEntry) -> float:
        return max(0.0, (entry.expires_at - self.clock()) * 1000.0)

    def next_expiry(self) -> float | None:
        """Monotonic time of the earliest expiry, None when empty."""
        return min((e.expires_at for e in self._by_id.values()), default=None)

    # -- changes (lock held) -------------------------------------------------------------

    def add(self, kind: int, instance: str, address: str, pid: int,
            stream_priorities: tuple[int, ...], memory_bytes: int) -> tuple[LeaseEntry, LeaseEntry | None]:
        """Registers ``instance``; returns (new entry, the entry it replaced or None).

        A live lease is never taken over, whatever the pid: the instance name
        is public (``Status``), the lease id is the holder's secret. A
        restarted process registers once its old lease has lapsed (after at
        most ``ttl_ms``); an expired lease the reaper has not reached yet is
        replaced, its memory freed, its watchers the caller's to close.
        Nothing changes on error.

        Raises:
            AlreadyExists: the instance holds a live lease.
            Exhausted: ``memory_bytes`` exceeds what is left, or the table is full.
        """
        now = self.clock()
        current = self._by_instance.get(instance)
        if current is not None and current.expires_at > now:
            held = "this pid" if current.pid == pid else "another pid"
            raise AlreadyExists(
                f"instance: {quote(instance)} already holds a live lease ({held}); "
                f"it expires in {self.expires_in_ms(current):.0f} ms unless renewed by its holder"
            )
        left = self.memory_left(current.memory_bytes if current is not None else 0)
        if left is not None and memory_bytes > left:
            raise Exhausted(
                f"memory_bytes: asked for {memory_bytes} bytes, {max(left, 0)} of "
                f"{self.capacity_bytes} left"
            )
        if current is None and len(self._by_id) >= self.max_leases:
            raise Exhausted(f"instance: the scheduler holds {len(self._by_id)} leases, the most it takes")
        if current is not None:
            self.remove(current)  # expired, not reaped yet
        entry = LeaseEntry(
            lease_id=secrets.token_hex(16),  # a secret: it alone proves the lease is the caller's
            kind=kind,
            instance=instance,
            address=address,
            pid=pid,
            stream_priorities=tuple(stream_priorities),
            memory_bytes=int(memory_bytes),
            expires_at=now + self.ttl_ms / 1000.0,
        )
        self._by_id[entry.lease_id] = entry
        self._by_instance[instance] = entry
        self._used_bytes += entry.memory_bytes
        self.wakeup.set()
        return entry, current

    def renew(self, entry: LeaseEntry) -> None:
        """Extends ``entry`` to ``ttl_ms`` from now."""
        entry.expires_at = self.clock() + self.ttl_ms / 1000.0

    def remove(self, entry: LeaseEntry) -> bool:
        """Drops ``entry`` and frees its memory; False if it was not in the table.

        Does not close its watchers: the caller decides with which status.
        """
        if self._by_id.get(entry.lease_id) is not entry:
            return False
        del self._by_id[entry.lease_id]
        if self._by_instance.get(entry.instance) is entry:
            del self._by_instance[entry.instance]
        self._used_bytes -= entry.memory_bytes
        return True

    def pop_expired(self) -> list[LeaseEntry]:
        """Removes and returns every lease past its expiry."""
        now = self.clock()
        expired = [e for e in self._by_id.values() if e.expires_at <= now]
        for entry in expired:
            self.remove(entry)
        return expired


class Reaper:
    """Thread that expires leases on time.

    ``on_expired(entries)`` is called with the table lock held, right after
    the entries were removed (to close their watchers and re-run the policy).
    It sleeps until the earliest expiry, or until a lease is added.
    """

    def __init__(self, table: LeaseTable, on_expired: Callable[[list[LeaseEntry]], None]):
        self._table = table
        self._on_expired = on_expired
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="scheduler-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopping = True
        self._table.wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        table = self._table
        while not self._stopping:
            with table.lock:
                table.wakeup.clear()
                expired = table.pop_expired()
                if expired:
                    try:
                        self._on_expired(expired)
                    except Exception:  # never let the reaper die
                        log.exception("expiring %d lease(s) failed", len(expired))
                due = table.next_expiry()
            timeout = None if due is None else max(due - table.clock(), 0.0005)
            table.wakeup.wait(timeout)

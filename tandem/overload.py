"""Overload shedding: while a server's admitted calls wait too long for a
thread, the calls that waited are refused as their thread starts, before
any work.

An admitted call waits between its arrival (the guard's admission, on gRPC's
polling thread) and the moment a worker thread starts serving it: for a
thread, and for the interpreter that every thread of the process shares. A
server offered more calls than it can serve lets that wait grow until every
call reaches its handler with its deadline spent and fails DEADLINE_EXCEEDED
at the client, late, after costing the server its work. The rule here is
CoDel's (K. Nichols, V. Jacobson, "Controlling Queue Delay", ACM Queue 10(5),
2012) in the form RPC servers use it (B. Maurer, "Fail at Scale", ACM Queue
13(8), 2015): the queue of admitted calls not yet started *stands* once it
has not been empty for ``interval``; while it stands, a call that waited
longer than ``target`` is refused RESOURCE_EXHAUSTED as its thread starts.
A frame's burst empties the queue well within the interval and never trips
it; a call after an idle spell starts an episode of its own; a standing
queue drains at the cost of refusals, which take a thread microseconds, not
a search, and the episode ends once it is empty.

Thread-safety: :class:`QueueWait` has no lock of its own: its caller
serializes every call to it (:class:`tandem.guard.Admission`'s lock).
"""
from __future__ import annotations

from prometheus_client import Counter

SHED = Counter("tandem_rpc_shed", "Calls refused by overload shedding (tandem/overload.py), by method.", ["method"])

#: How long the queue must not have been empty before it stands (s).
INTERVAL_S = 0.1


class QueueWait:
    """The shedding rule of one server's queue of admitted calls (module docstring).

    Args:
        target_ms: the longest wait (ms, arrival to thread start) of a call
            served while the queue stands (``server.queue_wait_target_ms``);
            0: never shed.
        interval_s: how long the queue must not have been empty before it
            stands (s; None: :data:`INTERVAL_S`).
    """

    def __init__(self, target_ms: float, interval_s: float | None = None):
        self.target_s = target_ms / 1000.0
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.queued = 0  # admitted calls whose thread has not started them
        self._busy_since = 0.0  # monotonic s: when ``queued`` last went from 0 to 1
        self.shed = 0  # calls refused

    def arrived(self, now: float) -> None:
        """A call is admitted at monotonic ``now`` (s)."""
        if not self.queued:
            self._busy_since = now
        self.queued += 1

    def gone(self) -> None:
        """An admitted call ended before its thread started it."""
        self.queued -= 1

    def started(self, waited_s: float, now: float) -> bool:
        """A call's thread starts it ``waited_s`` (s) after it arrived, at
        monotonic ``now`` (s); False: refuse it (the queue stands and it
        waited past the target)."""
        standing = now - self._busy_since > self.interval_s
        self.queued -= 1
        if self.target_s <= 0.0 or waited_s <= self.target_s or not standing:
            return True
        self.shed += 1
        return False

    def refusal(self, method: str, waited_s: float) -> str:
        """The RESOURCE_EXHAUSTED message of a call refused after ``waited_s`` (s)."""
        return (f"{method}: the server is overloaded: this call waited {waited_s * 1e3:.1f} ms for a thread, and "
                f"calls have queued for one without a break for {self.interval_s * 1e3:.0f} ms or more "
                f"(server.queue_wait_target_ms: {self.target_s * 1e3:g} ms); refused before any work, retry later")

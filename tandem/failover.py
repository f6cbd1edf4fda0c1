"""A unary call to a primary server, or to its standby while the primary is down.

The reward service's bulk server is the reward service's standby
(``reward.bulk_server.standby``): it loads the same models with a critical
lane of its own, so a frame's critical ``Evaluate`` that finds the reward
service gone (UNAVAILABLE: refused, reset, or draining) is sent there at
once, within what is left of its deadline, instead of failing the frame.

Rules (the client side of docs/reliability.md, "The critical path"):

* A call goes to the primary unless the primary failed UNAVAILABLE less than
  ``retry_primary_s`` ago; then straight to the standby. So clients move back
  to the primary by themselves, within ``retry_primary_s`` of it serving again.
* Only UNAVAILABLE moves a call: it says the call never reached a serving
  primary (nothing ran, or the process died with it; ``Evaluate`` has no side
  effects, so running it again elsewhere is safe). Every other status is the
  answer.
* The standby's call gets what is left of the caller's deadline; where none
  is left the caller gets the primary's UNAVAILABLE.

Thread-safe: one :class:`Failover` serves every thread of a client.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Callable

import grpc

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
STANDBY_KEY = "standby_server"  # ModelMetadata.runtime key of a reward service: its standby's address
RETRY_PRIMARY_S = 0.25  # after a failure, how long calls skip the primary (s)


class Failover:
    """Chooses the server of each call (module docstring).

    Args:
        primary, standby: ``request, timeout -> future`` (a grpc.Future or a
            concurrent.futures.Future) of the same method on the two servers
            (e.g. ``stub.Evaluate.future``);
            ``standby`` None: every call goes to the primary.
        retry_primary_s: how long after a failure calls skip the primary (s).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, primary: Callable, standby: Callable | None, retry_primary_s: float = RETRY_PRIMARY_S,
                 clock: Callable[[], float] = time.monotonic):
        self._primary, self._standby = primary, standby
        self._retry_s, self._clock = retry_primary_s, clock
        self._lock = threading.Lock()
        self._primary_down_until = 0.0  # guarded by _lock

    def _primary_down(self) -> bool:
        with self._lock:
            return self._clock() < self._primary_down_until

    def _mark(self, down: bool) -> None:
        with self._lock:
            self._primary_down_until = self._clock() + self._retry_s if down else 0.0

    def future(self, request, timeout: float) -> _FailoverFuture:
        """The call of ``request`` with ``timeout`` (s), as a future whose result
        is the answer of whichever server answered (``.server``: "primary" or
        "standby")."""
        return _FailoverFuture(self, request, timeout)


class _FailoverFuture:
    """What ``Failover.future`` returns: ``result()``, ``add_done_callback(fn)``,
    ``done()``, ``cancel()`` and ``server``, as a grpc.Future offers them (the
    parts the frame loop uses)."""

    def __init__(self, failover: Failover, request, timeout: float):
        self._f, self._request = failover, request
        self._deadline = failover._clock() + timeout
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._callbacks: list[Callable] = []  # guarded by _lock, until done
        self._call: grpc.Future | None = None  # the call in flight, then the one that answered
        self.server = ""
        if failover._standby is not None and failover._primary_down():
            self._send("standby")
        else:
            self._send("primary")

    def _send(self, server: str) -> None:
        self.server = server
        send = self._f._primary if server == "primary" else self._f._standby
        call = send(self._request, timeout=max(self._deadline - self._f._clock(), 0.0))
        with self._lock:
            self._call = call
        call.add_done_callback(self._on_done)

    def _on_done(self, call: grpc.Future) -> None:
        if self.server == "primary" and self._f._standby is not None:
            code = _code(call)
            self._f._mark(code == UNAVAILABLE)
            if code == UNAVAILABLE and self._deadline - self._f._clock() > 0:
                self._send("standby")
                return
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)

    def add_done_callback(self, fn: Callable) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None):
        """The answer. Raises grpc.RpcError (the answering server's), or
        grpc.FutureTimeoutError where ``timeout`` passed first."""
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        return self._call.result()

    def cancel(self) -> bool:
        with self._lock:
            call = self._call
        return call.cancel() if call is not None else False


def _code(call: grpc.Future) -> grpc.StatusCode:
    try:
        call.result()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()
    except (grpc.FutureCancelledError, futures.CancelledError):
        return grpc.StatusCode.CANCELLED

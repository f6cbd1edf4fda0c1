"""The interpreter gate: the hot gRPC handlers' Python work, one thread at a time.

Why (docs/decisions/0018): CPython gives its interpreter lock (the GIL) to
whichever waiting thread the OS wakes. A thread that lets the lock go many
times for short C calls -- the search service's wave loop, at every CUDA
launch, copy and synchronisation; the reward service's batcher lanes, at
every model run -- must win it back after each, against every runnable
thread. Under load dozens of gRPC handler threads are runnable, and each
short release costs the wave loop a wait behind them: its waves grew from
0.6 ms to over 5 ms at 32 engines, and admission then refused what the
engines asked. Behind the gate, handler threads queue on an ordinary lock,
asleep rather than competing for the GIL, so the wave loop and the lanes
compete with one handler at a time. The handlers' own throughput is the
same: their Python ran one at a time anyway.

Invariants:

* A thread holds the gate only while it runs the Python of a gated unary
  handler (:class:`tandem.guard.Guard` takes it around the handler of each
  method of :data:`GATED`: ``Search``, ``SearchBatch``, ``Evaluate``),
  never while it waits for a request message, a response write or a lock.
* A gated handler lets the gate go (:meth:`Gate.released`) around each wait
  for another thread's work -- the wave loop's answer, the batcher's -- and
  around its slow calls into the kernel or the GPU (tandem/peer.py's
  lookups of a connection, a session tree's re-rooting), and holds no other
  lock then. So a thread
  waiting for the gate never holds a lock that the gate's holder waits
  for: no deadlock.
* Threads that do the GPU work (the wave loop, the batcher lanes, the leaf
  channel's) never take the gate: they only ever compete for the GIL.
* Re-entrant per thread: ``held`` inside ``held`` does nothing;
  ``released`` on a thread that does not hold it does nothing.

``server.interpreter_gate`` (tandem/config.py) turns it off (``held`` then
does nothing); one gate per process, shared by its servers (co-located: on
where either server's is).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from prometheus_client import Summary

# How long gated handlers waited at the gate (count and sum): a rate of waits near the calls'
# and a growing mean say the handlers' Python is the server's bound.
WAITS = Summary("tandem_interpreter_gate_wait_seconds", "Time gated handlers waited for the interpreter gate")


class Gate:
    """A process's interpreter gate (module docstring). Thread-safe."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._configured = False  # set by the first configure()
        self._lock = threading.Lock()
        self._mine = threading.local()  # .held: this thread holds the gate

    def configure(self, on: bool) -> None:
        """A server's ``server.interpreter_gate``, as it starts: the first
        server of the process sets the gate, a later one (co-located mode)
        can only turn it on."""
        self.enabled = (self.enabled or on) if self._configured else on
        self._configured = True

    def holds(self) -> bool:
        """Whether the calling thread holds the gate."""
        return getattr(self._mine, "held", False)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The block runs holding the gate (where enabled and not held already)."""
        if not self.enabled or self.holds():
            yield
            return
        self._take()
        try:
            yield
        finally:
            self._mine.held = False
            self._lock.release()

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """The block runs without the gate, taken back after it, where the
        calling thread held it (a wait for another thread's work: no lock
        may be held across it)."""
        if not self.holds():
            yield
            return
        self._mine.held = False
        self._lock.release()
        try:
            yield
        finally:
            self._take()

    def _take(self) -> None:
        """Takes the gate for the calling thread; a wait for it is counted (WAITS)."""
        if not self._lock.acquire(blocking=False):
            t = time.perf_counter()
            self._lock.acquire()
            WAITS.observe(time.perf_counter() - t)
        self._mine.held = True


# The gated methods: unary, hot under load, and each of their waits for other threads' work
# released (search_service/server.py, reward_service/server.py).
GATED = frozenset({"/tandem.v1.SearchService/Search", "/tandem.v1.SearchService/SearchBatch",
                   "/tandem.v1.RewardService/Evaluate"})
GATE = Gate()  # the process's: tandem.server.build_server configures it from server.interpreter_gate

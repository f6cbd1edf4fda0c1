"""The CUDA streams the search service launches on, one per stream priority.

Priority is fixed when a CUDA stream is created (docs/design.md, "Measured
physics", consequence 3), so the service holds one stream per priority it
registered with the scheduler and the scheduler's assignment picks which one
the next search launches on. Streams are created lazily, on first use, and
only where CuPy sees a GPU; elsewhere the assignment is still recorded (and
exported as a metric) so that the scheduler's decisions can be followed and
tested on a CPU host.

Concurrency invariants:

* ``assign`` and ``launching`` may run on any thread at any time. The
  assigned and active priorities are one tuple, replaced by a single
  reference write under ``_lock``; readers take the tuple once.
* A search reads the active priority once, when it enters ``launching``,
  and keeps that stream for its whole run: an assignment takes effect from
  the next search, never in the middle of one (the kernels of one search
  stay ordered on one stream).
* Streams, once created, are never destroyed while the service lives
  (a search on another thread may still be using one).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, Sequence

from tandem.stream_priority import nearest_allowed

log = logging.getLogger(__name__)


class StreamSet:
    """Priority -> CuPy stream, and which one is in use.

    Args:
        priorities: the CUDA stream priorities the service may be assigned
            (0 = least urgent, negative = more urgent; e.g. ``(0, -5)``).
        cupy: the CuPy module where CuPy sees a GPU, else None (CPU host:
            no streams are created, assignments are only recorded).

    Raises:
        ValueError: ``priorities`` is empty.
    """

    def __init__(self, priorities: Sequence[int], cupy=None):
        if not priorities:
            raise ValueError("priorities: at least one stream priority is needed")
        self.held = tuple(sorted(set(priorities), reverse=True))  # least urgent first
        self.cupy = cupy
        self._lock = threading.Lock()
        self._streams: dict[int, object] = {}  # guarded by _lock; only grows
        self._state = (self.held[0], self.held[0])  # (assigned, active); replaced whole under _lock

    @property
    def on_gpu(self) -> bool:
        return self.cupy is not None

    @property
    def assigned_priority(self) -> int:
        """The priority the scheduler last assigned (the least held one before any assignment)."""
        return self._state[0]

    @property
    def active_priority(self) -> int:
        """The held priority the next search launches on."""
        return self._state[1]

    def assign(self, priority: int) -> int:
        """Records the scheduler's assignment; returns the priority now in use
        (the most urgent held priority that does not exceed ``priority``)."""
        active = nearest_allowed(priority, self.held)
        with self._lock:
            changed = self._state[1] != active
            self._state = (priority, active)
        if changed:
            log.info("search: stream priority %d in use (assigned %d)", active, priority)
        return active

    def stream(self, priority: int):
        """The CuPy stream of ``priority`` (created on first use); None on a CPU host.

        Raises:
            KeyError: ``priority`` is not held.
        """
        if self.cupy is None:
            return None
        if priority not in self.held:
            raise KeyError(f"stream priority {priority} is not held (held: {list(self.held)})")
        with self._lock:
            s = self._streams.get(priority)
            if s is None:
                s = self._streams[priority] = self.cupy.cuda.Stream(non_blocking=True, priority=priority)
            return s

    @contextlib.contextmanager
    def launching(self) -> Iterator[int]:
        """Makes the active stream the current CuPy stream of this thread for
        the block (a no-op on a CPU host); yields the priority in use."""
        priority = self._state[1]
        s = self.stream(priority)
        if s is None:
            yield priority
            return
        with s:
            yield priority


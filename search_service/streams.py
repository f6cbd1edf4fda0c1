"""The CUDA streams the search service launches on, one per stream priority.

A stream's priority is fixed when the CUDA stream is created (docs/design.md,
"Measured physics", consequence 3), so the service holds one stream per
stream priority it registered with the scheduler, and the scheduler's
assignment picks which one the next search launches on
(:func:`tandem.stream_priority.nearest_allowed`, the rule the reward service
follows too). Streams are created lazily, on first use, and
only where CuPy sees a GPU; elsewhere the assignment is still recorded (and
exported as a metric) so that the scheduler's decisions can be followed and
tested on a CPU host.

Concurrency invariants:

* ``assign`` and ``launching`` may run on any thread at any time. The
  assigned and active stream priorities are one tuple, replaced by a single
  reference write under ``_lock``; readers take the tuple once.
* A search reads the active stream priority once, when it enters ``launching``,
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
    """CUDA stream priority -> CuPy stream, and which one is in use.

    Args:
        stream_priorities: the CUDA stream priorities the service may be
            assigned (0 = least urgent, negative = more urgent; e.g. ``(0, -5)``).
        cupy: the CuPy module where CuPy sees a GPU, else None (CPU host:
            no streams are created, assignments are only recorded).

    Raises:
        ValueError: ``stream_priorities`` is empty.
    """

    def __init__(self, stream_priorities: Sequence[int], cupy=None):
        if not stream_priorities:
            raise ValueError("stream_priorities: at least one stream priority is needed")
        self.held = tuple(sorted(set(stream_priorities), reverse=True))  # least urgent first
        self.cupy = cupy
        self._lock = threading.Lock()
        self._streams: dict[int, object] = {}  # guarded by _lock; only grows
        self._state = (self.held[0], self.held[0])  # (assigned, active); replaced whole under _lock

    @property
    def on_gpu(self) -> bool:
        return self.cupy is not None

    @property
    def assigned_stream_priority(self) -> int:
        """The stream priority the scheduler last assigned (the least urgent held one before any assignment)."""
        return self._state[0]

    @property
    def active_stream_priority(self) -> int:
        """The held stream priority the next search launches on."""
        return self._state[1]

    def assign(self, stream_priority: int) -> int:
        """Records the scheduler's assignment; returns the stream priority now
        in use: :func:`~tandem.stream_priority.nearest_allowed`, the most
        urgent held one that is no more urgent than ``stream_priority``."""
        active = nearest_allowed(stream_priority, self.held)
        with self._lock:
            changed = self._state[1] != active
            self._state = (stream_priority, active)
        if changed:
            log.info("search: stream priority %d in use (assigned %d)", active, stream_priority)
        return active

    def stream(self, stream_priority: int):
        """The CuPy stream of ``stream_priority`` (created on first use); None on a CPU host.

        Raises:
            KeyError: ``stream_priority`` is not held.
        """
        if self.cupy is None:
            return None
        if stream_priority not in self.held:
            raise KeyError(f"stream priority {stream_priority} is not held (held: {list(self.held)})")
        with self._lock:
            s = self._streams.get(stream_priority)
            if s is None:
                s = self._streams[stream_priority] = self.cupy.cuda.Stream(non_blocking=True, priority=stream_priority)
            return s

    @contextlib.contextmanager
    def launching(self) -> Iterator[int]:
        """Makes the active stream the current CuPy stream of this thread for
        the block (a no-op on a CPU host); yields the stream priority in use."""
        stream_priority = self._state[1]
        s = self.stream(stream_priority)
        if s is None:
            yield stream_priority
            return
        with s:
            yield stream_priority


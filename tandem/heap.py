"""glibc's allocator in the servers: what a refused large request leaves
behind is given back (issue 41; docs/reliability.md, "A refused request's
memory").

* :func:`fix_mmap_threshold` (every server at start, from
  ``tandem.server.build_server``): by default glibc raises its mmap threshold
  to the size of each large block freed (up to 32 MiB), so after one large
  request the next ones' copies come from the heap, and the heap keeps them:
  12.8 MB OIP ModelInfers refused one at a time grew the reward service's RSS
  by 92-111 MiB after 6-12 refusals; with the threshold fixed at 1 MiB the
  same run grew at most 13 MiB and the peak fell from 352 to 180 MiB (2-core
  CPU host, 2026-12-06). Fixing it also turns the growth off (mallopt(3)).
* :data:`HEAP_TRIMMER` (``tandem.guard``, after a call refused with a request
  message of :data:`TRIM_AFTER_BYTES` or more): gRPC receives a message in
  blocks under 1 MiB, whose free space between live blocks stays resident: 8
  refused 16 MiB ModelInfers (6 of them three at once) grew the reward
  service's RSS by up to 67 MiB with the threshold alone (3 of 20 runs over
  50 MiB), by -13 to +11 MiB with the trim in 20 runs (same host and day).

Where the C library has neither function (musl, macOS) nothing is done and
a line is logged at debug.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
TRIM_AFTER_BYTES = 1 << 20  # a call refused after a request message this large has the heaps trimmed


def _libc(name: str, argtypes: tuple, why: str) -> Callable[..., int] | None:
    """The C library's function ``name`` (int result), or None (logged at debug, ``why``) where it has none."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError, TypeError) as exc:  # TypeError: Windows has no CDLL(None)
        log.debug("%s: the C library has no %s (%s)", why, name, exc)
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Has glibc's malloc serve every block of ``threshold`` bytes or more with
    its own mmap, returned to the system when freed, so a refused large message
    leaves no memory behind in the heap. True where it was set; False (logged
    at debug) where the C library has no ``mallopt`` (musl, macOS) or refuses."""
    mallopt = _libc("mallopt", (ctypes.c_int, ctypes.c_int), "mmap threshold left as it is")
    if mallopt is None:
        return False
    if mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        log.debug("mmap threshold left as it is: mallopt(M_MMAP_THRESHOLD, %d) refused", threshold)
        return False
    return True


class HeapTrimmer:
    """One daemon thread that has glibc give the free pages of its heaps back
    to the system (``malloc_trim(0)``) after :meth:`request`: off the thread
    that asks (gRPC's polling thread runs call-end callbacks), with requests
    that come while a trim runs served by one more trim. A trim took 0.07-51 ms
    (median 1.4 ms, p99 34 ms; 166 trims, 2-core CPU host, 2026-12-06). Does
    nothing where the C library has no ``malloc_trim``."""

    def __init__(self):
        self._trim = _libc("malloc_trim", (ctypes.c_size_t,), "freed memory left to the C library")
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None  # guarded by _lock
        self.trims = 0  # trims done (for tests)

    def request(self) -> bool:
        """Asks for a trim; False where the C library has no ``malloc_trim``."""
        if self._trim is None:
            return False
        with self._lock:
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="heap-trimmer", daemon=True)
                self._thread.start()
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self._trim(0)  # ctypes lets go of the interpreter's lock meanwhile
            self.trims += 1


HEAP_TRIMMER = HeapTrimmer()  # shared by every server of the process

"""Bytes in flight: the reward service admits an Evaluate only while the
requests it is serving hold less than ``reward.max_bytes_in_flight`` together.

A request is counted by its serialized size (its tensors' bytes, which the
decoded arrays share without a copy) from admission to its answer. Bulk
requests may fill only ``BULK_SHARE`` of the bound, so the rest is kept for
critical ones; a request that finds nothing in flight is always admitted (a
request of any size the message limit lets through can be served, alone).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

BULK_SHARE = 0.75  # of max_bytes_in_flight, the most bulk requests may hold together with the rest


class OverBudget(Exception):
    """The request would take the bytes in flight past the bound; the message says by how much."""


class ByteBudget:
    """Thread-safe: ``_lock`` guards ``_held``.

    Args:
        limit: the bound (bytes); 0: none.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0  # guarded by _lock

    @property
    def held(self) -> int:
        """Bytes of the requests admitted and not yet answered."""
        with self._lock:
            return self._held

    @contextmanager
    def admit(self, nbytes: int, critical: bool) -> Iterator[None]:
        """Holds ``nbytes`` for the block.

        Raises:
            OverBudget: in flight are already ``held`` bytes and these would pass
                the bound (for bulk requests, ``BULK_SHARE`` of it).
        """
        bound = self.limit if critical else int(self.limit * BULK_SHARE)
        with self._lock:
            if self.limit and self._held and self._held + nbytes > bound:
                lane = "critical" if critical else f"bulk: {BULK_SHARE:.0%} of"
                raise OverBudget(f"{self._held} bytes of requests in flight and this one's {nbytes} would pass "
                                 f"the limit of {bound} ({lane} reward.max_bytes_in_flight); retry later")
            self._held += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._held -= nbytes

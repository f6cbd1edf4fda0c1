"""Bytes in flight: the reward service admits an Evaluate only while the
requests it is serving hold less than ``reward.max_bytes_in_flight`` together.

A request is counted by what the server holds for it, from admission to its
answer: :data:`INPUT_COPIES` times its serialized size (the message as
received, the parsed message, its tensors' bytes as the decoded arrays see
them, their batch's copy: the first is freed as the message is parsed) and,
once its rows are known, :data:`OUTPUT_COPIES` times its outputs' bytes (the
model's outputs, the reply). Counting the serialized size alone let 12
concurrent 37 MiB batches add 823 MiB of resident memory under a 256 MiB
bound (issue 41); a 9.2 MiB Evaluate raises the server's peak resident
memory by 1.1-2.9x its size, as measured (CPU, 2026-12-05). Bulk requests
may fill only ``BULK_BYTES_FRACTION`` of the bound (a byte budget; the scheduler's *bulk share* is a share of time), so the rest is kept for critical
ones; a request that finds nothing in flight is always admitted (a request
of any size the message limit lets through can be served, alone).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

BULK_BYTES_FRACTION = 0.75  # of max_bytes_in_flight, the most bulk requests may hold together with the rest
INPUT_COPIES = 3  # working copies of a request's serialized bytes the server holds at once (module docstring)
OUTPUT_COPIES = 2  # and of its outputs' bytes


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
    def admit(self, nbytes: int, critical: bool) -> Iterator[Held]:
        """Holds ``nbytes`` for the block; the :class:`Held` it gives may hold more.

        Raises:
            OverBudget: in flight are already ``held`` bytes and these would pass
                the bound (for bulk requests, ``BULK_BYTES_FRACTION`` of it).
        """
        held = Held(self, critical)
        held.grow(nbytes)
        try:
            yield held
        finally:
            with self._lock:
                self._held -= held.nbytes

    def _take(self, nbytes: int, critical: bool, mine: int) -> None:
        """Adds ``nbytes`` to what is held, for a request already holding ``mine``."""
        bound = self.limit if critical else int(self.limit * BULK_BYTES_FRACTION)
        with self._lock:
            others = self._held - mine
            if self.limit and others and self._held + nbytes > bound:
                lane = "critical" if critical else f"bulk: {BULK_BYTES_FRACTION:.0%} of"
                raise OverBudget(f"{others} bytes of requests in flight and this one's {mine + nbytes} would pass "
                                 f"the limit of {bound} ({lane} reward.max_bytes_in_flight); retry later")
            self._held += nbytes


class Held:
    """What one admitted request holds of a :class:`ByteBudget` (its thread's alone)."""

    def __init__(self, budget: ByteBudget, critical: bool):
        self._budget, self._critical = budget, critical
        self.nbytes = 0

    def grow(self, nbytes: int) -> None:
        """Holds ``nbytes`` more until the request is answered.

        Raises:
            OverBudget: as :meth:`ByteBudget.admit` (what it held stays held until then).
        """
        self._budget._take(nbytes, self._critical, self.nbytes)  # noqa: SLF001 - the budget's own helper
        self.nbytes += nbytes

"""The frame deadline as one value: an absolute instant on one clock.

A search's deadline is asked as a budget (``SearchRequest.deadline_ms``, ms
from the call) and bounded by the caller's gRPC deadline; from there on it
travels as a :class:`Deadline` -- through the wave loop, the wave plan, the
leaf evaluators, the leaf channel and the in-process worker handle, to the
reward service's batcher -- and every stage asks it what it needs: the time
left (:meth:`Deadline.left_ms`, :meth:`Deadline.left_s`), whether it has
passed (:meth:`Deadline.passed`), the nearest of several (:func:`earliest`).

The clock is ``time.monotonic()`` (CLOCK_MONOTONIC on Linux): never set back,
and one clock for every process on a host, so an instant may cross a process
boundary in shared memory. Over gRPC and the leaf channel's socket a deadline
travels as the time left (gRPC's own timeout; the wave message's
``timeout_us``) and is made absolute again where it arrives
(:meth:`Deadline.after_s`, :meth:`Deadline.of_grpc`).

Every method that reads the clock takes ``now`` (``time.monotonic()`` s; None:
read it), so a caller that asks several questions at one instant -- or a test
-- passes the same instant to each.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

# A gRPC call without a deadline reports None, or an "infinite" time remaining (years):
# remaining times beyond this (s, ~4 months) mean no deadline.
NO_DEADLINE_S = 1e7


@dataclass(frozen=True, order=True, slots=True)
class Deadline:
    """The instant by which an answer is due, ``at``: ``time.monotonic()``
    seconds. Immutable; ordered by ``at`` (the nearer deadline is the smaller).
    A missing deadline is None, never a Deadline."""

    at: float

    @staticmethod
    def now() -> float:
        """The deadlines' clock: ``time.monotonic()`` (s)."""
        return time.monotonic()

    @classmethod
    def after_s(cls, seconds: float, now: float | None = None) -> Deadline:
        """The deadline ``seconds`` (s; may be <= 0: passed) from ``now``."""
        return cls((time.monotonic() if now is None else now) + seconds)

    @classmethod
    def after_ms(cls, ms: float, now: float | None = None) -> Deadline:
        """The deadline ``ms`` (ms; may be <= 0: passed) from ``now``: a budget such as ``deadline_ms``."""
        return cls.after_s(ms / 1e3, now)

    @classmethod
    def of_grpc(cls, context, now: float | None = None) -> Deadline | None:
        """The gRPC caller's deadline (``context.time_remaining()``, s), or
        None where the call has none (None, or more than ``NO_DEADLINE_S``)."""
        remaining = context.time_remaining()
        if remaining is None or remaining > NO_DEADLINE_S:
            return None
        return cls.after_s(remaining, now)

    def left_s(self, now: float | None = None) -> float:
        """Seconds left until the deadline (s; negative once it has passed)."""
        return self.at - (time.monotonic() if now is None else now)

    def left_ms(self, now: float | None = None) -> float:
        """Milliseconds left until the deadline (ms; negative once it has passed)."""
        return self.left_s(now) * 1e3

    def passed(self, now: float | None = None) -> bool:
        """Whether the deadline has come (``now >= at``)."""
        return self.left_s(now) <= 0

    def wait_s(self, now: float | None = None) -> float:
        """A wait's timeout that ends at the deadline (s): the time left, at
        least 0 and at most ``threading.TIMEOUT_MAX`` (a far deadline must not
        overflow the platform's timeout type)."""
        return min(max(self.left_s(now), 0.0), threading.TIMEOUT_MAX)

    def later_s(self, seconds: float) -> Deadline:
        """This deadline moved ``seconds`` later (s; a grace past it)."""
        return Deadline(self.at + seconds)


def earliest(*deadlines: Deadline | None) -> Deadline | None:
    """The nearest of ``deadlines``, None ignored; None where every one is None."""
    known = [d for d in deadlines if d is not None]
    return min(known) if known else None


def within_s(deadline: Deadline | None, seconds: float, now: float | None = None) -> Deadline:
    """``deadline``, but at most ``seconds`` (s) from ``now``: a call's own
    timeout caps a far deadline or stands in for a missing one."""
    cap = Deadline.after_s(seconds, now)
    return cap if deadline is None else min(deadline, cap)

"""The frame deadline's value type (tandem/deadline.py): every instant injected, no timing."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from search_service.budget import REPLY_MARGIN_MIN_MS, search_deadline
from tandem.deadline import NO_DEADLINE_S, Deadline, earliest, within_s


class Context:
    """The part of a gRPC context a deadline reads."""

    def __init__(self, remaining_s):
        self.remaining_s = remaining_s

    def time_remaining(self):
        return self.remaining_s


def test_a_budget_becomes_an_instant_on_the_monotonic_clock():
    assert Deadline.after_ms(16.0, now=100.0) == Deadline(100.016)
    assert Deadline.after_s(2.0, now=100.0) == Deadline(102.0)
    assert Deadline.after_ms(-5.0, now=100.0).passed(100.0)  # a budget already spent


def test_time_left_and_passed_at_a_given_instant():
    d = Deadline(100.0)
    assert d.left_s(99.5) == pytest.approx(0.5) and d.left_ms(99.5) == pytest.approx(500.0)
    assert d.left_ms(100.25) == pytest.approx(-250.0)  # negative once passed
    assert not d.passed(99.999) and d.passed(100.0) and d.passed(100.001)


def test_a_wait_ends_at_the_deadline_never_negative_nor_overflowing():
    d = Deadline(100.0)
    assert d.wait_s(99.0) == pytest.approx(1.0)
    assert d.wait_s(101.0) == 0.0
    assert Deadline(1e300).wait_s(0.0) == threading.TIMEOUT_MAX


def test_a_deadline_is_immutable_and_ordered_by_its_instant():
    d = Deadline(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.at = 2.0  # type: ignore[misc]
    assert Deadline(1.0) < Deadline(2.0) and max(Deadline(1.0), Deadline(2.0)) == Deadline(2.0)
    assert d.later_s(0.5) == Deadline(1.5) and d == Deadline(1.0)


def test_earliest_ignores_missing_deadlines():
    assert earliest(None, Deadline(3.0), Deadline(2.0), None) == Deadline(2.0)
    assert earliest(None, None) is None and earliest() is None


def test_a_call_timeout_caps_a_far_or_missing_deadline():
    assert within_s(None, 2.0, now=10.0) == Deadline(12.0)
    assert within_s(Deadline(11.0), 2.0, now=10.0) == Deadline(11.0)
    assert within_s(Deadline(50.0), 2.0, now=10.0) == Deadline(12.0)


def test_the_grpc_deadline_counts_from_now_and_an_infinite_one_is_none():
    assert Deadline.of_grpc(Context(0.25), now=10.0) == Deadline(10.25)
    assert Deadline.of_grpc(Context(None), now=10.0) is None
    assert Deadline.of_grpc(Context(NO_DEADLINE_S * 10), now=10.0) is None  # "no deadline" as years left


def test_a_search_deadline_counts_from_the_receipt_capped_by_the_callers():
    # No gRPC deadline: the request's budget, or the service's limit.
    assert search_deadline(16.0, None, 60_000.0, now=5.0) == (16.0, Deadline.after_ms(16.0, 5.0))
    assert search_deadline(0.0, None, 60_000.0, now=5.0) == (60_000.0, Deadline.after_ms(60_000.0, 5.0))
    # A nearer gRPC deadline (10 ms left at the receipt) less the reply margin.
    ms, got = search_deadline(16.0, Deadline(5.010), 60_000.0, now=5.0)
    assert ms == pytest.approx(10.0 - REPLY_MARGIN_MIN_MS) and got.left_ms(5.0) == pytest.approx(ms)
    # A budget below the clock's resolution stays a budget (> 0), though its instant is the receipt's.
    ms, got = search_deadline(1e-300, None, 60_000.0, now=30_000.0)
    assert ms == 1e-300 and got.at == 30_000.0

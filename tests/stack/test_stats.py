"""stack/stats.py: NumPy's linear-interpolation percentiles and the latency summary,
against hand-computed values."""
from __future__ import annotations

import pytest

from stack.stats import percentiles, summary


def test_percentiles_interpolate_linearly_between_closest_ranks():
    # Ranks 0..3 of [1, 2, 3, 4]: p50 at rank 1.5 -> 2.5; p99 at rank 2.97 -> 3 + 0.97 * (4 - 3).
    p0, p25, p50, p99, p100 = percentiles([4.0, 1.0, 3.0, 2.0], 0, 25, 50, 99, 100)
    assert (p0, p25, p50, p100) == (1.0, 1.75, 2.5, 4.0)
    assert p99 == pytest.approx(3.97)
    # Fewer than 100 values: p99 lies between the two largest.
    assert 3.0 < p99 < 4.0


def test_percentiles_of_one_value_and_of_a_generator():
    assert percentiles([7.5], 1, 50, 99) == (7.5, 7.5, 7.5)
    assert percentiles((x * 10.0 for x in range(11)), 50, 90) == (50.0, 90.0)  # ranks 5 and 9 exactly


def test_percentiles_are_floats_in_the_input_unit():
    (p50,) = percentiles([1, 2, 3], 50)
    assert type(p50) is float and p50 == 2.0


def test_percentiles_of_nothing_are_none_one_per_q():
    assert percentiles([], 50, 99) == (None, None)
    assert percentiles(iter(()), 50) == (None,)


@pytest.mark.parametrize("q", [-1, 100.5])
def test_a_percentile_outside_0_100_is_refused(q):
    with pytest.raises(ValueError):
        percentiles([1.0, 2.0], q)


def test_summary_of_four_values():
    assert summary([4.0, 1.0, 3.0, 2.0]) == {"p50": 2.5, "p99": 3.97, "max": 4.0, "mean": 2.5}


def test_summary_rounds_to_digits():
    # p50 2.34567; mean 7.03701 / 3 = 2.34567; p99 at rank 1.98: 2.34567 + 0.98 * (3.45678 - 2.34567) = 3.4345578
    values = [1.23456, 2.34567, 3.45678]
    assert summary(values, digits=2) == {"p50": 2.35, "p99": 3.43, "max": 3.46, "mean": 2.35}
    assert summary(values) == {"p50": 2.346, "p99": 3.435, "max": 3.457, "mean": 2.346}


def test_summary_of_nothing_is_all_none():
    assert summary([]) == {"p50": None, "p99": None, "max": None, "mean": None}
    assert summary(x for x in ()) == {"p50": None, "p99": None, "max": None, "mean": None}

"""The one percentile helper of the engine, the load tests and the benchmarks.

Percentiles are NumPy's (linear interpolation between the closest ranks), so
with fewer than 100 values p99 lies between the two largest. Both helpers keep
the unit of their input: give them ms, they answer in ms.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentiles(values: Iterable[float], *qs: float) -> tuple[float | None, ...]:
    """The ``qs``-th percentiles (0-100) of ``values``, unrounded; all None
    when there are no values.

    Raises:
        ValueError: a q outside [0, 100].
    """
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return (None,) * len(qs)
    return tuple(float(x) for x in np.percentile(a, qs))


def summary(values: Iterable[float], digits: int = 3) -> dict[str, float | None]:
    """``{"p50", "p99", "max", "mean"}`` of ``values``, rounded to ``digits``
    places; all None when there are none. The latency figure of the play and
    load-generator reports."""
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {"p50": None, "p99": None, "max": None, "mean": None}
    p50, p99 = percentiles(a, 50, 99)
    return {"p50": round(p50, digits), "p99": round(p99, digits),
            "max": round(float(a.max()), digits), "mean": round(float(a.mean()), digits)}

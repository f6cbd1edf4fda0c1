"""A model run's failures as gRPC statuses: one mapping for every way a
request reaches the batcher (``Evaluate``, the Open Inference Protocol's
``ModelInfer`` through it, the leaf channel)."""
from __future__ import annotations

import grpc
import numpy as np

from reward_service.batcher import Batcher, BatcherClosed, BatcherError, DeadlineExceeded, QueueFull, Request
from tandem import pools
from tandem.deadline import Deadline


class Refusal(Exception):
    """A request answered with ``code`` and ``message``; ``reason`` is its
    failure reason in the per-model metrics (model_metrics.REASONS)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def run(batcher: Batcher, model: str, feeds: dict[str, np.ndarray], rows: int, request_class: int,
        deadline: Deadline | None, names, targets: dict | None = None, on_written=None,
        events=None) -> Request:
    """Runs ``feeds`` (``rows`` rows) through ``batcher`` and returns the done
    request (``outputs``, ``queue_ms``, ``compute_ms``, ``bucket``; ``targets``,
    ``on_written``, ``events``: see :class:`reward_service.batcher.Request`).

    Raises:
        Refusal: DEADLINE_EXCEEDED (not run by ``deadline``; None: none),
            RESOURCE_EXHAUSTED (queue full, memory pool full), UNAVAILABLE
            (stopping), INTERNAL (the run failed).
    """
    try:
        done = batcher.evaluate(feeds, rows, request_class, deadline, names, targets, on_written, events)
        done.result()
        return done
    except Exception as exc:
        raise refusal_for(exc, model) from None


def refusal_for(exc: Exception, model: str) -> Refusal:
    """The Refusal for what a batcher submit, wait or run of ``model`` raised."""
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, DeadlineExceeded):
        return Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", f"model {model!r}: {exc}; not run")
    if isinstance(exc, QueueFull):
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full", str(exc))
    if isinstance(exc, BatcherClosed):
        return Refusal(grpc.StatusCode.UNAVAILABLE, "unavailable", str(exc))
    if isinstance(exc, BatcherError):  # pragma: no cover - every batcher error is mapped above
        return Refusal(grpc.StatusCode.INTERNAL, "run_failed", str(exc))
    if pools.is_out_of_memory(exc):  # the model run failed (logged by the batcher): beyond the fixed arena
        return Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "out_of_memory", f"model {model!r}: memory pool full: {exc}")
    return Refusal(grpc.StatusCode.INTERNAL, "run_failed", f"model {model!r}: run failed: {exc}")

"""A model run's failures as gRPC statuses: one mapping for every way a
request reaches the batcher (``Evaluate``, the Open Inference Protocol's
``ModelInfer`` through it, the leaf channel)."""
from __future__ import annotations

import grpc
import numpy as np

from reward_service.batcher import Batcher, BatcherClosed, BatcherError, DeadlineExceeded, QueueFull, Request
from tandem import pools


class Refusal(Exception):
    """A request answered with ``code`` and ``message``; ``reason`` is its
    failure reason in the per-model metrics (model_metrics.REASONS)."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message


def run(batcher: Batcher, model: str, feeds: dict[str, np.ndarray], rows: int, request_class: int,
        deadline: float | None, names, targets: dict | None = None, on_written=None,
        events=None) -> Request:
    """Runs ``feeds`` (``rows`` rows) through ``batcher`` and returns the done
    request (``outputs``, ``queue_ms``, ``compute_ms``, ``bucket``; ``targets``,
    ``on_written``, ``events``: see :class:`reward_service.batcher.Request`).

    Raises:
        Refusal: DEADLINE_EXCEEDED (not run by ``deadline``, time.monotonic()
            s), RESOURCE_EXHAUSTED (queue full, memory pool full), UNAVAILABLE
            (stopping), INTERNAL (the run failed).
    """
    try:
        done = batcher.evaluate(feeds, rows, request_class, deadline, names, targets, on_written, events)
        done.result()
        return done
    except DeadlineExceeded as exc:
        raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", f"model {model!r}: {exc}; not run") from None
    except QueueFull as exc:
        raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full", str(exc)) from None
    except BatcherClosed as exc:
        raise Refusal(grpc.StatusCode.UNAVAILABLE, "unavailable", str(exc)) from None
    except BatcherError as exc:  # pragma: no cover - every batcher error is mapped above
        raise Refusal(grpc.StatusCode.INTERNAL, "run_failed", str(exc)) from None
    except Exception as exc:  # the model run failed (logged by the batcher)
        if pools.is_out_of_memory(exc):  # beyond the fixed arena (gpu_mem_limit)
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "out_of_memory",
                          f"model {model!r}: memory pool full: {exc}") from None
        raise Refusal(grpc.StatusCode.INTERNAL, "run_failed", f"model {model!r}: run failed: {exc}") from None

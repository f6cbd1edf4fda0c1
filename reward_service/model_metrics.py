"""Per-model serving figures of the reward service: Prometheus families under
the names users of inference servers know, and the running totals behind the
Open Inference Protocol's ModelStatistics (reward_service/oip.py).

Families (labels ``model``; ``lane`` is ``critical`` or ``bulk``, the
batcher's lanes; seconds, ``_total`` counters, ratios 0-1):

* ``tandem_reward_model_requests_total{model,lane}``: requests for the model
  (Evaluate and OIP ModelInfer alike), bad ones included;
* ``tandem_reward_model_request_successes_total{model,lane}``;
* ``tandem_reward_model_request_failures_total{model,lane,reason}``, reason one
  of :data:`REASONS`;
* ``tandem_reward_model_executions_total{model,lane}``: model runs (batches);
* ``tandem_reward_model_queue_seconds{model,lane}``: a request's wait before
  its batch ran (histogram);
* ``tandem_reward_model_compute_seconds{model,lane}``: one model run (histogram);
* ``tandem_reward_model_batch_size{model,lane}``: real rows per run (histogram);
* ``tandem_reward_model_batch_fill_ratio{model,lane}``: real rows / padded rows
  per run, 0-1 (histogram);
* ``tandem_reward_model_pending_requests{model,lane}``: requests queued now.

Requests for a model the server does not have are not counted per model (the
name is the client's, unbounded): they show in ``tandem_rpc_latency_seconds``
with code NOT_FOUND.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import Counter, Gauge, Histogram

from reward_service.batcher import LANES
from tandem import multiprocess_metrics
from tandem.server import LATENCY_BUCKETS_S

#: Why a request for a known model failed (the ``reason`` label).
REASONS = (
    "invalid_input",  # INVALID_ARGUMENT: tensors, output names, parameters
    "deadline_exceeded",  # the deadline passed before it ran
    "queue_full",  # RESOURCE_EXHAUSTED: refused or shed by the bounded queue
    "bytes_in_flight",  # RESOURCE_EXHAUSTED: reward.max_bytes_in_flight (reward_service/admission.py)
    "out_of_memory",  # RESOURCE_EXHAUSTED: the fixed memory pool
    "unavailable",  # the service is stopping
    "shared_memory",  # a shared-memory region could not be used
    "wrong_server",  # FAILED_PRECONDITION: a critical request at the bulk server (reward.bulk_server)
    "run_failed",  # INTERNAL: the model run raised
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
FILL_BUCKETS = (0.125, 0.25, 0.5, 0.75, 0.9, 1.0)

_LABELS = ["model", "lane"]
REQUESTS = Counter("tandem_reward_model_requests", "Requests for a model, bad ones included.", _LABELS)
SUCCESSES = Counter("tandem_reward_model_request_successes", "Requests answered with the model's outputs.", _LABELS)
FAILURES = Counter("tandem_reward_model_request_failures", "Requests that failed, by reason.", [*_LABELS, "reason"])
EXECUTIONS = Counter("tandem_reward_model_executions", "Model runs (one per batch).", _LABELS)
QUEUE_SECONDS = Histogram("tandem_reward_model_queue_seconds", "Time a request waited before its batch ran (s).",
                          _LABELS, buckets=LATENCY_BUCKETS_S)
COMPUTE_SECONDS = Histogram("tandem_reward_model_compute_seconds", "Time of one model run (s).", _LABELS,
                            buckets=LATENCY_BUCKETS_S)
BATCH_SIZE = Histogram("tandem_reward_model_batch_size", "Real rows per model run.", _LABELS, buckets=BATCH_BUCKETS)
BATCH_FILL = Histogram("tandem_reward_model_batch_fill_ratio", "Real rows over padded rows per model run (0-1).",
                       _LABELS, buckets=FILL_BUCKETS)
PER_LANE = (REQUESTS, SUCCESSES, EXECUTIONS, QUEUE_SECONDS, COMPUTE_SECONDS, BATCH_SIZE, BATCH_FILL)
PENDING = Gauge("tandem_reward_model_pending_requests", "Requests queued for the model now.", _LABELS,
                multiprocess_mode="livesum")  # summed over workers (tandem/workers.py)


@dataclass
class Duration:
    """A count and a total duration (ns): Triton's StatisticDuration."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.ns += int(seconds * 1e9)


@dataclass
class Totals:
    """One model's running totals since the server started (ModelStatistics).

    ``inference_count``: rows answered; ``execution_count``: model runs;
    ``last_inference_ms``: Unix time of the last answered request (ms);
    ``batches``: real rows per run -> duration of those runs.
    """

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=dict)


class ModelMetrics:
    """Records requests and runs of the models a reward server serves.

    Thread-safe: gRPC threads record requests, each lane's worker its runs;
    ``_lock`` guards the totals. Nothing is recorded until :meth:`start` (the
    server's own warm-up requests are not the clients').

    The families' labelled children are looked up once each and kept
    (``_children``): ``labels()`` checks the labels and takes the family's
    lock on every call, seven calls per leaf-channel wave.
    A child lives as long as its family (nothing here removes one). The
    series of every served model and lane are made at :meth:`start`, at 0
    (Prometheus' advice for label values known in advance: a dashboard sees
    0, not nothing); making them there also keeps the children's creation
    off the first request's path. Failure series appear at their first
    failure (their reasons are not known in advance).
    """

    def __init__(self, models: list[str]):
        self._lock = threading.Lock()
        self._totals = {m: Totals() for m in models}  # guarded by _lock
        self._live = False
        # (family, labels) -> family.labels(*labels). Not locked: two threads making one child
        # both get the family's own (labels() returns the child it holds), and a dict store is atomic.
        self._children: dict[tuple, object] = {}

    def _child(self, family, *labels: str):
        """``family.labels(*labels)``, kept after the first call."""
        try:
            return self._children[family, labels]
        except KeyError:
            child = self._children[family, labels] = family.labels(*labels)
            return child

    def start(self) -> None:
        """Counts from now on (called once the server has warmed up); makes
        every served model's and lane's series, at 0."""
        for model in self._totals:
            for lane in LANES.values():
                for family in PER_LANE:
                    self._child(family, model, lane)
        self._live = True

    def watch_pending(self, model: str, lane: str, queued: Callable[[], int]) -> None:
        """The pending gauge of ``model``'s ``lane`` reads ``queued()`` at each scrape (under
        workers: every second too, tandem/multiprocess_metrics.py)."""
        multiprocess_metrics.set_function(PENDING.labels(model, lane), queued)

    def requested(self, model: str, lane: str) -> None:
        if self._live:
            self._child(REQUESTS, model, lane).inc()

    def succeeded(self, model: str, lane: str, rows: int, elapsed_s: float, queue_s: float) -> None:
        """A request of ``rows`` rows answered after ``elapsed_s`` (handler
        entry to reply), of which ``queue_s`` waiting in its lane."""
        if not self._live:
            return
        self._child(SUCCESSES, model, lane).inc()
        self._child(QUEUE_SECONDS, model, lane).observe(queue_s)
        with self._lock:
            t = self._totals[model]
            t.inference_count += rows
            t.last_inference_ms = int(time.time() * 1e3)
            t.success.add(elapsed_s)
            t.queue.add(queue_s)

    def failed(self, model: str, lane: str, reason: str, elapsed_s: float) -> None:
        """A request that failed for ``reason`` (one of :data:`REASONS`) after ``elapsed_s``.

        Raises:
            ValueError: an unknown reason (a programming error).
        """
        if reason not in REASONS:
            raise ValueError(f"reason: {reason!r} is not one of {REASONS}")
        if not self._live:
            return
        self._child(FAILURES, model, lane, reason).inc()
        with self._lock:
            self._totals[model].fail.add(elapsed_s)

    def executed(self, model: str, lane: str, rows: int, padded_rows: int, compute_s: float) -> None:
        """One model run of ``rows`` real rows padded to ``padded_rows``, taking ``compute_s``."""
        if not self._live:
            return
        self._child(EXECUTIONS, model, lane).inc()
        self._child(COMPUTE_SECONDS, model, lane).observe(compute_s)
        self._child(BATCH_SIZE, model, lane).observe(rows)
        self._child(BATCH_FILL, model, lane).observe(rows / max(padded_rows, rows, 1))
        with self._lock:
            t = self._totals[model]
            t.execution_count += 1
            t.compute.add(compute_s)
            t.batches.setdefault(rows, Duration()).add(compute_s)

    def totals(self, model: str) -> Totals:
        """A copy of ``model``'s totals (KeyError for a model not served)."""
        with self._lock:
            t = self._totals[model]
            return Totals(t.inference_count, t.execution_count, t.last_inference_ms,
                          Duration(t.success.count, t.success.ns), Duration(t.fail.count, t.fail.ns),
                          Duration(t.queue.count, t.queue.ns), Duration(t.compute.count, t.compute.ns),
                          {k: Duration(v.count, v.ns) for k, v in t.batches.items()})

"""Dynamic batcher: merges queued Evaluate requests of one model into batches.

Pure Python threading, no GPU: the model run is a callback (``run``) that
gets a :class:`Batch` and returns its outputs. One :class:`Batcher` per model,
one worker thread per batcher.

Policy
------
* Two request classes, the proto's ``tandem.v1.RequestClass`` values:
  ``REQUEST_CLASS_CRITICAL`` (a search waiting inside a game frame) before
  ``REQUEST_CLASS_BULK`` (throughput work). Within a class, first in, first
  out. (Request classes order the queue; they are not CUDA stream
  priorities.)
* A batch holds up to ``max_rows`` rows (``min(max_batch_size, largest
  bucket)``). It is padded to the smallest bucket that holds it (fixed shapes
  that a GPU session replays as CUDA graphs); a single request larger than
  every bucket runs alone, unpadded.
* Critical requests never wait for company: when the worker is free and a
  critical request is queued, a batch is formed at once from the queued
  critical requests; queued bulk requests then ride along only in the rows
  the padding would waste (the critical batch's bucket does not grow).
* Bulk requests wait up to ``max_queue_delay_us`` (from the oldest one's
  arrival) for more to merge with, unless ``max_rows`` rows are queued.
* Deadlines: a request whose deadline (``time.monotonic()`` seconds) has
  passed is never run; it completes with :class:`DeadlineExceeded` (at
  submit, or when the worker next forms a batch).
* Bounded queue: at most ``max_queue_size`` requests wait. A full queue sheds:
  a bulk request is refused (:class:`QueueFull`); a critical one displaces
  the newest queued bulk request (which completes with QueueFull) or, when
  none is queued, is refused.
* Requests are validated before they are submitted (the servicer decodes and
  checks them), so a batch fails only if the model run itself fails; then
  every request in that batch gets the error.
* Batch rows must be independent (true of every inference-mode network here):
  a request's outputs do not depend on what it was merged or padded with.

Concurrency invariants
----------------------
* ``_lock`` guards ``_queues``, ``_queued`` (requests waiting), ``_closed``,
  the counters in ``_stats``, and every :attr:`Request.state` change.
  ``_wake`` is a Condition on ``_lock``: submit and close notify it; the
  worker waits on it.
* A request's state goes QUEUED -> RUNNING -> DONE or QUEUED -> DONE, only
  under ``_lock``; exactly one party (the worker, a shedding submit, or a
  cancelling waiter) moves it to DONE, and that party writes its result
  fields *before* setting ``_done``. Waiters read the result only after
  ``_done`` is set (Event.set/wait order the writes before the reads).
* ``run`` is called from the worker thread only, never concurrently with
  itself, and never under ``_lock`` (submitters are not blocked by a model
  run). So a run callback may reuse preallocated buffers without a lock.
  Running a request on the submitting gRPC thread when the batcher is idle
  would spare two thread hand-offs (~0.17 ms p50 on the H200), but ONNX
  Runtime's CUDA execution provider keeps per-thread state (cuBLAS/cuDNN
  handles, workspaces): the first run on each new gRPC thread took 6.5 ms
  there (2026-11-30), so runs stay on this one thread.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
from tandem.v1 import reward_pb2

log = logging.getLogger(__name__)

_CLASSES = (reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK)  # queue order: critical first

QUEUED, RUNNING, DONE = "queued", "running", "done"
_MAX_WAIT_S = 3600.0  # longest single Event.wait (a deadline days away is waited for in steps)


class BatcherError(Exception):
    """Base of the batcher's own errors (the servicer maps each to a gRPC status)."""


class QueueFull(BatcherError):
    """The model's queue holds ``max_queue_size`` requests (RESOURCE_EXHAUSTED)."""


class DeadlineExceeded(BatcherError):
    """The request's deadline passed before it ran (DEADLINE_EXCEEDED)."""


class BatcherClosed(BatcherError):
    """The batcher is stopping and takes no more requests (UNAVAILABLE)."""


@dataclass(eq=False)
class Request:
    """One submitted request.

    ``feeds``: input name -> array with ``rows`` rows (first dimension), every
    input of the model, already validated. ``output_names``: outputs to return
    (empty: all that ``run`` returns). ``request_class``:
    ``reward_pb2.REQUEST_CLASS_CRITICAL`` or ``REQUEST_CLASS_BULK``.
    ``deadline``: ``time.monotonic()`` seconds, or None for none.

    Filled in when done: ``outputs`` (name -> array with ``rows`` rows) or
    ``error``; ``queue_ms`` (arrival to run start, ms), ``compute_ms`` (the
    batch's run, ms), ``batch_rows`` (real rows of the batch it ran in) and
    ``bucket`` (rows after padding).
    """

    feeds: dict[str, np.ndarray]
    rows: int
    request_class: int = reward_pb2.REQUEST_CLASS_BULK
    deadline: float | None = None
    output_names: tuple[str, ...] = ()
    enqueued: float = 0.0
    state: str = QUEUED  # guarded by Batcher._lock
    outputs: dict[str, np.ndarray] | None = None
    error: BaseException | None = None
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    batch_rows: int = 0
    bucket: int = 0
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until done or ``timeout_s`` passed; True when done."""
        return self._done.wait(timeout_s)

    def result(self) -> dict[str, np.ndarray]:
        """The outputs of a done request.

        Raises:
            BatcherError: shed, expired or closed; or whatever the model run raised.
            RuntimeError: called before the request is done.
        """
        if not self._done.is_set():
            raise RuntimeError("request not done yet")
        if self.error is not None:
            raise self.error
        return self.outputs


@dataclass(eq=False)
class Batch:
    """Requests merged into one model run: ``rows`` real rows, padded to ``bucket``.

    Request ``i`` holds rows ``offsets[i] : offsets[i] + requests[i].rows``.
    """

    requests: list[Request]
    rows: int
    bucket: int
    offsets: list[int]

    @property
    def names(self) -> list[str]:
        return list(self.requests[0].feeds)

    def fill(self, buffers: dict[str, np.ndarray], zero_padding: bool = True) -> None:
        """Copies every request's rows into ``buffers`` (name -> array of at
        least ``bucket`` rows, the inputs' dtypes and row shapes), and zeroes
        rows ``rows:bucket`` unless ``zero_padding`` is false."""
        for name, buf in buffers.items():
            for req, off in zip(self.requests, self.offsets):
                buf[off : off + req.rows] = req.feeds[name]
            if zero_padding and self.bucket > self.rows:
                buf[self.rows : self.bucket] = 0

    def feeds(self) -> dict[str, np.ndarray]:
        """Input name -> array of ``bucket`` rows (padding zeroed). A lone,
        unpadded request's own arrays are returned without a copy."""
        if len(self.requests) == 1 and self.bucket == self.rows:
            return dict(self.requests[0].feeds)
        out = {
            name: np.empty((self.bucket, *a.shape[1:]), a.dtype) for name, a in self.requests[0].feeds.items()
        }
        self.fill(out)
        return out


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``rows``; ``rows`` itself when none is (or no buckets)."""
    for b in buckets:
        if b >= rows:
            return b
    return rows


class Batcher:
    """Queues requests for one model and runs them in merged batches.

    Args:
        run: ``run(batch) -> {output name: array of >= batch.rows rows}``;
            called from the worker thread only. Arrays it returns must not be
            reused by later runs (requests keep views of them).
        buckets: ascending batch sizes to pad to; empty: no padding.
        max_batch_size: most rows in one batch (merging stops there).
        max_queue_delay_us: how long bulk requests wait for company (µs).
        max_queue_size: most requests waiting (running ones not counted).
        name: for the worker thread's name and logs.
        clock: ``time.monotonic`` (tests may pass another monotonic clock).
        warm_up: called once on the worker thread before it takes any request
            (the model's warm-up: ONNX Runtime's CUDA execution provider keeps
            per-thread state); the constructor returns when it is done.

    Raises:
        ValueError: a non-positive size, a negative delay, unsorted buckets.
        Exception: whatever ``warm_up`` raised (the worker has then stopped).
    """

    def __init__(
        self,
        run: Callable[[Batch], dict[str, np.ndarray]],
        *,
        buckets: Sequence[int] = (),
        max_batch_size: int = 1024,
        max_queue_delay_us: float = 0.0,
        max_queue_size: int = 256,
        name: str = "model",
        clock: Callable[[], float] = time.monotonic,
        merge: bool = True,
        warm_up: Callable[[], None] | None = None,
    ):
        buckets = tuple(int(b) for b in buckets)
        if list(buckets) != sorted(set(buckets)) or any(b <= 0 for b in buckets):
            raise ValueError(f"buckets must be positive and strictly ascending, got {list(buckets)}")
        if max_batch_size <= 0 or max_queue_size <= 0 or max_queue_delay_us < 0:
            raise ValueError("max_batch_size and max_queue_size must be > 0, max_queue_delay_us >= 0")
        self._run = run
        # False: one request per batch, for models whose requests cannot be
        # concatenated (a fixed batch size, or another dynamic dimension).
        self.merge = merge
        self.buckets = buckets
        self.max_rows = min(max_batch_size, buckets[-1]) if buckets else max_batch_size
        self.max_queue_delay_s = max_queue_delay_us * 1e-6
        self.max_queue_size = max_queue_size
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queues = {c: collections.deque() for c in _CLASSES}  # guarded by _lock
        self._queued = 0  # guarded by _lock
        self._closed = False  # guarded by _lock
        self._stats = collections.Counter()  # guarded by _lock
        self._warm_up = warm_up
        self._warm_up_error: BaseException | None = None
        self._warmed = threading.Event()
        self._worker = threading.Thread(target=self._loop, name=f"batcher-{name}", daemon=True)
        self._worker.start()
        self._warmed.wait()
        if self._warm_up_error is not None:
            raise self._warm_up_error

    # -- the submitting side (gRPC threads) ------------------------------------

    def submit(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        request_class: int = reward_pb2.REQUEST_CLASS_BULK,
        deadline: float | None = None,
        output_names: Sequence[str] = (),
    ) -> Request:
        """Queues a validated request and returns it (wait on it for the result).

        ``request_class``: ``reward_pb2.REQUEST_CLASS_CRITICAL`` or
        ``REQUEST_CLASS_BULK`` (the servicer maps UNSPECIFIED to bulk).

        Raises:
            DeadlineExceeded: ``deadline`` has passed already.
            QueueFull: the queue is full and nothing may be shed for it.
            BatcherClosed: :meth:`close` was called.
            ValueError: ``rows`` < 1 or another ``request_class``.
        """
        if rows < 1:
            raise ValueError("rows must be >= 1")
        if request_class not in _CLASSES:
            raise ValueError(
                f"request_class: expected REQUEST_CLASS_CRITICAL or REQUEST_CLASS_BULK, got {request_class}"
            )
        now = self._clock()
        req = Request(feeds, rows, request_class, deadline, tuple(output_names), enqueued=now)
        if deadline is not None and deadline <= now:
            with self._lock:
                self._stats["expired"] += 1
            raise DeadlineExceeded("deadline passed before the request was queued")
        victim = None
        with self._lock:
            if self._closed:
                raise BatcherClosed(f"model {self.name!r}: the reward service is stopping")
            if self._queued >= self.max_queue_size:
                bulk = self._queues[reward_pb2.REQUEST_CLASS_BULK]
                if request_class != reward_pb2.REQUEST_CLASS_CRITICAL or not bulk:
                    self._stats["refused"] += 1
                    raise QueueFull(
                        f"model {self.name!r}: queue full ({self.max_queue_size} requests waiting); retry later"
                    )
                victim = bulk.pop()  # the newest bulk request makes room for a critical one
                victim.state = DONE
                victim.error = QueueFull(f"model {self.name!r}: queue full; shed for a critical request")
                self._queued -= 1
                self._stats["shed"] += 1
            self._queues[request_class].append(req)
            self._queued += 1
            self._stats["submitted"] += 1
            self._wake.notify()
        if victim is not None:
            victim._done.set()
        return req

    def cancel(self, req: Request) -> bool:
        """Takes a still-queued request out of the queue (its waiter gave up):
        it completes with DeadlineExceeded. False when it is running or done."""
        with self._lock:
            if req.state != QUEUED:
                return False
            self._queues[req.request_class].remove(req)
            self._queued -= 1
            req.state = DONE
            req.error = DeadlineExceeded("deadline passed while queued")
            self._stats["expired"] += 1
        req._done.set()
        return True

    def evaluate(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        request_class: int = reward_pb2.REQUEST_CLASS_BULK,
        deadline: float | None = None,
        output_names: Sequence[str] = (),
    ) -> Request:
        """:meth:`submit`, then waits until done or until ``deadline``.

        Returns the done request (``result()`` gives its outputs).

        Raises:
            DeadlineExceeded: the deadline passed first (a queued request is
                taken out of the queue and never run).
            QueueFull, BatcherClosed, ValueError: as :meth:`submit`.
        """
        req = self.submit(feeds, rows, request_class, deadline, output_names)
        while True:
            # Bounded waits: a far deadline must not overflow the platform's timeout type.
            timeout = None if deadline is None else min(max(deadline - self._clock(), 0.0), _MAX_WAIT_S)
            if req.wait(timeout):
                return req
            if deadline is not None and deadline <= self._clock():
                if self.cancel(req) or not req.wait(0.0):
                    raise DeadlineExceeded("deadline passed before the result was ready")
                return req

    def stats(self) -> dict:
        """``queued`` (requests waiting), ``oldest_age_ms`` (0 when none) and
        the counters ``submitted``, ``batches``, ``expired``, ``shed``, ``refused``."""
        with self._lock:
            heads = [q[0].enqueued for q in self._queues.values() if q]
            age = (self._clock() - min(heads)) * 1e3 if heads else 0.0
            return {"queued": self._queued, "oldest_age_ms": age, **dict(self._stats)}

    def close(self, timeout_s: float = 5.0) -> None:
        """Refuses new requests, lets the worker run what is queued, joins it."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        self._worker.join(timeout_s)

    # -- the worker ------------------------------------------------------------

    def _loop(self) -> None:
        try:
            if self._warm_up is not None:
                self._warm_up()
        except BaseException as exc:  # handed to the constructor, which raises it
            self._warm_up_error = exc
            return
        finally:
            self._warmed.set()
        while True:
            with self._lock:
                while True:
                    if self._queued == 0:
                        if self._closed:
                            return
                        self._wake.wait()
                        continue
                    wait_s = self._merge_wait_locked()
                    if wait_s <= 0:
                        break
                    self._wake.wait(wait_s)
                expired, batch = self._take_locked()
            for req in expired:
                req._done.set()
            if batch is not None:
                self._execute(batch)

    def _merge_wait_locked(self) -> float:
        """Seconds to wait for more bulk requests; <= 0: form a batch now."""
        if self._closed or self._queues[reward_pb2.REQUEST_CLASS_CRITICAL]:
            return 0.0
        bulk = self._queues[reward_pb2.REQUEST_CLASS_BULK]
        if sum(r.rows for r in bulk) >= self.max_rows:
            return 0.0
        return bulk[0].enqueued + self.max_queue_delay_s - self._clock()

    def _take_locked(self) -> tuple[list[Request], Batch | None]:
        """Drops expired requests (returned, marked DONE) and takes the next batch."""
        now = self._clock()
        expired = []
        for c in _CLASSES:
            q = self._queues[c]
            if any(r.deadline is not None and r.deadline <= now for r in q):
                keep = collections.deque()
                for r in q:
                    if r.deadline is not None and r.deadline <= now:
                        r.state = DONE
                        r.error = DeadlineExceeded("deadline passed while queued")
                        expired.append(r)
                    else:
                        keep.append(r)
                self._queues[c] = keep
        self._queued -= len(expired)
        self._stats["expired"] += len(expired)
        taken: list[Request] = []
        rows = 0
        cap = self.max_rows
        for c in _CLASSES:
            q = self._queues[c]
            if taken and not self.merge:
                break
            while q and (not taken or (self.merge and rows + q[0].rows <= cap)):
                req = q.popleft()
                taken.append(req)
                rows += req.rows
                if rows > cap:  # a lone request larger than every bucket
                    break
            if c == reward_pb2.REQUEST_CLASS_CRITICAL and taken:
                # Bulk rides along only in rows the padding would waste.
                cap = min(cap, bucket_for(rows, self.buckets))
            if rows >= cap:
                break
        if not taken:
            return expired, None
        for req in taken:
            req.state = RUNNING
        self._queued -= len(taken)
        self._stats["batches"] += 1
        offsets = np.cumsum([0] + [r.rows for r in taken[:-1]]).tolist()
        bucket = bucket_for(rows, self.buckets) if rows <= self.max_rows else rows
        return expired, Batch(taken, rows, bucket, offsets)

    def _execute(self, batch: Batch) -> None:
        start = self._clock()
        try:
            outputs = self._run(batch)
            error = None
        except Exception as exc:  # the model run failed: every request in it gets the error
            log.exception("model %s: batch of %d rows failed", self.name, batch.rows)
            outputs, error = None, exc
        compute_ms = (self._clock() - start) * 1e3
        for req, off in zip(batch.requests, batch.offsets):
            req.queue_ms = (start - req.enqueued) * 1e3
            req.compute_ms = compute_ms
            req.batch_rows, req.bucket = batch.rows, batch.bucket
            if error is None:
                try:
                    names = req.output_names or tuple(outputs)
                    req.outputs = {n: outputs[n][off : off + req.rows] for n in names}
                except Exception as exc:  # e.g. an output without a batch dimension
                    log.exception("model %s: cannot split the batch's outputs", self.name)
                    req.error = exc
            else:
                req.error = error
        with self._lock:
            for req in batch.requests:
                req.state = DONE
        for req in batch.requests:
            req._done.set()

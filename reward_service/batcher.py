"""Dynamic batcher: merges queued Evaluate requests of one model into batches.

Pure Python threading, no GPU: the model run is a callback (``run``) that
gets a :class:`Batch` and returns its outputs. One :class:`Batcher` per model;
per batcher two **lanes**, one per request class, each with its own queue and
its own long-lived worker thread, running side by side.

Policy
------
* Two request classes, the proto's ``tandem.v1.RequestClass`` values:
  ``REQUEST_CLASS_CRITICAL`` (a game frame, a search's wave of leaves) and
  ``REQUEST_CLASS_BULK`` (throughput work). Each class has its own lane: a
  queue (first in, first out) and a worker thread. Lanes never mix: a batch
  holds requests of one class only (:attr:`Batch.lane`), and a critical
  request never waits for a bulk batch to finish -- the critical worker runs
  beside the bulk one. (The run callback decides what each lane runs on: the
  reward service gives the critical lane its own ONNX Runtime sessions on the
  most urgent CUDA stream priority the model holds, reward_service/session.py.)
* A batch holds up to ``max_rows`` rows (``min(max_batch_size, largest
  bucket)``). It is padded to the smallest bucket that holds it (fixed shapes
  that a GPU session replays as CUDA graphs); a single request larger than
  every bucket runs alone, unpadded. Padding rows are zeros, never another
  lane's requests.
* Critical requests never wait for company: when the critical worker is free
  and a critical request is queued, a batch is formed at once from the
  queued critical requests.
* Bulk requests wait up to ``max_queue_delay_us`` (from the oldest one's
  arrival) for more to merge with, unless ``max_rows`` rows are queued.
* Bulk share (the scheduler's lever over bulk work, scheduler/policy.py):
  the bulk lane may run batches only ``bulk_share`` percent of wall time. After
  a bulk batch that ran t seconds, the bulk worker forms no batch for
  ``t * (100 / bulk_share - 1)`` seconds (none at 100 %, the default). A new
  share applies at once, also to the idle time already begun. The critical
  lane is never held back.
* Deadlines: a request whose deadline (a :class:`~tandem.deadline.Deadline`,
  read on the batcher's clock) has passed is never run; it completes with :class:`DeadlineExceeded` (at
  submit, or when its lane's worker next forms a batch).
* Bounded queue: at most ``max_queue_size`` requests wait, over both lanes
  together. A full queue sheds: a bulk request is refused
  (:class:`QueueFull`); a critical one displaces the newest queued bulk
  request (which completes with QueueFull) or, when none is queued, is
  refused.
* Requests are validated before they are submitted (the servicer decodes and
  checks them), so a batch fails only if the model run itself fails; then
  every request in that batch gets the error.
* Batch rows must be independent (true of every inference-mode network here):
  a request's outputs do not depend on what it was merged or padded with.

Concurrency invariants
----------------------
* One lock, ``_lock``, for the whole batcher (both lanes: the queue bound and
  shedding span them). It guards every lane's ``queue`` and ``stats``,
  ``_queued`` (requests waiting, both lanes), ``_closed``, ``_bulk_share``,
  each lane's ``last_busy_s``/``last_end``, and every
  :attr:`Request.state` change. Each lane has its own Condition on
  ``_lock``, ``wake``: a submit notifies only its own lane's worker; close
  notifies both. A worker waits only on its own lane's condition.
* A request's state goes QUEUED -> RUNNING -> DONE or QUEUED -> DONE, only
  under ``_lock``; exactly one party (its lane's worker, a shedding submit, or
  a cancelling waiter) moves it to DONE, and that party writes its result
  fields *before* setting ``_done``. Waiters read the result only after
  ``_done`` is set (Event.set/wait order the writes before the reads). A
  request's ``on_written`` runs on the worker between the two, outside
  ``_lock``, after every request of the batch without one is set done, and
  only reads the result fields; ``answered`` is written before ``_done`` is
  set, so the waiter reads it after. Every request's ``_done`` is set
  whatever a callback raises.
* A lane's worker is the only thread that takes requests from that lane's
  queue and the only one that calls ``run`` with that lane's batches. So
  ``run`` is never called concurrently with itself *for one lane*, but the
  two lanes' calls do overlap: a run callback may reuse preallocated buffers
  without a lock only if each lane has its own (``batch.lane`` says which).
  ``run`` is never called under ``_lock`` (submitters and the other lane are
  not blocked by a model run).
* ``warm_up(lane)`` runs on that lane's worker thread, before the thread
  takes any request: the critical lane's first, then the bulk lane's, one
  after the other (the constructor waits for each), never two at once --
  cuDNN's algorithm search times candidate kernels and would time them
  against the other warm-up's kernels.
* Why a long-lived thread per lane, not the submitting gRPC thread: running
  a request on the gRPC thread when the batcher is idle would spare two
  thread hops (~0.17 ms p50 on the H200), but ONNX Runtime's CUDA
  execution provider keeps per-thread state (cuBLAS/cuDNN handles,
  workspaces): the first run on each new gRPC thread took 6.5 ms there
  (2026-11-30), so each lane's runs stay on its one thread, forever.
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

from tandem import timeline
from tandem.deadline import Deadline

log = logging.getLogger(__name__)

CRITICAL, BULK = reward_pb2.REQUEST_CLASS_CRITICAL, reward_pb2.REQUEST_CLASS_BULK
LANES = {CRITICAL: "critical", BULK: "bulk"}  # request class -> lane name (thread names, stats, metrics)

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
    ``deadline``: a :class:`~tandem.deadline.Deadline`, or None for none.

    ``targets``: output name -> device array of ``rows`` rows (a leaf
    channel's CUDA output region), or None: where a bound runner that runs
    the request from device inputs writes its outputs, device to device, before
    the batch's one synchronisation; it then sets ``targets_written`` and the
    request's ``outputs`` are empty (the caller writes them otherwise).

    ``on_written``: with ``targets``, called with the request by the lane's
    worker once the run wrote every target, after the result fields and
    before ``_done`` is set; it then sets ``answered``. A leaf channel's
    reply is sent so from the worker thread, a thread hop before its
    waiting connection thread would wake (~40 µs a wave). It runs on the
    lane's one worker, so it must never block (a non-blocking send); it
    returns whether it answered, and when it did not (such a send refused),
    or raised (logged), ``answered`` stays False: the waiter answers
    instead, on its own thread.

    ``events``: a leaf channel's CUDA events (an object with ``ready`` and
    ``done``: tandem/cuda_events.py; ``ready`` may be a ready word's poll,
    tandem/ready_word.py), or None. The run waits for ``ready`` (a host
    poll, at most session.READY_WAIT_S -- a ready word's, from its previous
    outputs' end -- and not past ``deadline``)
    before it reads the feeds, and records ``done`` after it wrote the
    targets; ``inputs_late`` says the wait ran out (the request ran with
    whatever its rows held, and ``targets_written`` stays False: the caller
    answers it with an error). A run whose every request has targets and events is not
    synchronised at all: ``targets_written`` then means the copies are queued
    on the runner's stream, ordered before ``done``, and ``compute_ms`` is the
    host's time to queue the run, not the GPU's.

    Filled in when done: ``outputs`` (name -> array with ``rows`` rows) or
    ``error``; ``queue_ms`` (arrival to run start, ms), ``compute_ms`` (the
    batch's run, ms), ``batch_rows`` (real rows of the batch it ran in) and
    ``bucket`` (rows after padding).
    """

    feeds: dict[str, np.ndarray]
    rows: int
    request_class: int = reward_pb2.REQUEST_CLASS_BULK
    deadline: Deadline | None = None
    output_names: tuple[str, ...] = ()
    enqueued: float = 0.0
    targets: dict | None = None
    targets_written: bool = False
    on_written: Callable[[Request], bool] | None = None
    events: object | None = None
    inputs_late: bool = False
    answered: bool = False
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
    """Requests of one lane merged into one model run: ``rows`` real rows,
    padded to ``bucket``; ``lane`` is their request class.

    Request ``i`` holds rows ``offsets[i] : offsets[i] + requests[i].rows``.
    """

    requests: list[Request]
    rows: int
    bucket: int
    offsets: list[int]
    lane: int = BULK  # the request class of every request in it (lanes never mix)

    @property
    def names(self) -> list[str]:
        return list(self.requests[0].feeds)

    @property
    def on_device(self) -> bool:
        """Whether every request's feeds are device (CuPy) arrays: a leaf
        channel's wave in its CUDA region, which a bound runner copies device
        to device."""
        return all(on_device(a) for r in self.requests for a in r.feeds.values())

    def fill(self, buffers: dict[str, np.ndarray], zero_padding: bool = True) -> None:
        """Copies every request's rows into ``buffers`` (name -> array of at
        least ``bucket`` rows, the inputs' dtypes and row shapes), and zeroes
        rows ``rows:bucket`` unless ``zero_padding`` is false. Device feeds
        are copied to the host here."""
        for name, buf in buffers.items():
            for req, off in zip(self.requests, self.offsets):
                buf[off : off + req.rows] = to_host(req.feeds[name])
            if zero_padding and self.bucket > self.rows:
                buf[self.rows : self.bucket] = 0

    def feeds(self) -> dict[str, np.ndarray]:
        """Input name -> array of ``bucket`` rows (padding zeroed). A lone,
        unpadded request's own arrays are returned without a copy."""
        if len(self.requests) == 1 and self.bucket == self.rows:
            return {n: to_host(a) for n, a in self.requests[0].feeds.items()}
        out = {
            name: np.empty((self.bucket, *a.shape[1:]), a.dtype) for name, a in self.requests[0].feeds.items()
        }
        self.fill(out)
        return out


def on_device(array) -> bool:
    """Whether ``array`` is a CUDA device array (CuPy, or any type with the CUDA
    array interface). Asked of the type: CuPy builds the interface's dict on
    every access of the instance's attribute (µs per feed, per batch)."""
    return hasattr(type(array), "__cuda_array_interface__")


def to_host(array) -> np.ndarray:
    """``array`` as a NumPy array (a device array is copied to the host)."""
    return array.get() if on_device(array) else array


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``rows``; ``rows`` itself when none is (or no buckets)."""
    for b in buckets:
        if b >= rows:
            return b
    return rows


class _Lane:
    """One request class's queue and worker thread.

    ``queue``, ``stats`` and the worker's taking of requests are guarded by
    the owning :class:`Batcher`'s ``_lock``; ``wake`` is a Condition on that
    lock which only this lane's worker waits on. ``thread``, ``warmed`` and
    ``warm_up_error`` are written once, before the constructor returns
    (``warm_up_error`` before ``warmed`` is set, read after).
    """

    def __init__(self, request_class: int, lock: threading.Lock):
        self.request_class = request_class
        self.name = LANES[request_class]
        self.queue: collections.deque[Request] = collections.deque()  # guarded by Batcher._lock
        self.stats: collections.Counter = collections.Counter()  # guarded by Batcher._lock
        self.wake = threading.Condition(lock)
        self.thread: threading.Thread | None = None
        self.last_busy_s = 0.0  # guarded by Batcher._lock: how long the last batch ran (s)
        self.last_end = 0.0  # guarded by Batcher._lock: when it ended (clock seconds)
        # guarded by Batcher._lock: queue + model ms of the requests answered since the last
        # take_latencies() (bounded: only the latest are kept between two load reports)
        self.latencies_ms: collections.deque[float] = collections.deque(maxlen=_LATENCY_WINDOW)
        self.warmed = threading.Event()
        self.warm_up_error: BaseException | None = None

    def oldest_age_ms(self, now: float) -> float:
        """Age of the oldest queued request (ms; 0 when none). Under Batcher._lock."""
        return (now - self.queue[0].enqueued) * 1e3 if self.queue else 0.0


_LATENCY_WINDOW = 4096  # per lane: requests remembered between two load reports (~8 s at 480/s)
_COUNTERS = ("submitted", "batches", "expired", "shed", "refused")


class Batcher:
    """Queues requests for one model and runs them in merged batches, one
    lane (queue and worker thread) per request class.

    Args:
        run: ``run(batch) -> {output name: array of >= batch.rows rows}``;
            called from the worker thread of ``batch.lane`` only, so the two
            lanes' calls may overlap (see the module's invariants). Arrays it
            returns must not be reused by later runs (requests keep views of them).
        buckets: ascending batch sizes to pad to; empty: no padding.
        max_batch_size: most rows in one batch (merging stops there).
        max_queue_delay_us: how long bulk requests wait for company (µs).
        max_queue_size: most requests waiting, both lanes together (running
            ones not counted).
        name: for the worker threads' names (``batcher-<name>-critical``,
            ``batcher-<name>-bulk``) and logs.
        clock: ``time.monotonic``, the deadlines' clock (tests may pass
            another monotonic clock, and deadlines on it).
        merge: False: one request per batch (models whose requests cannot be
            concatenated).
        warm_up: ``warm_up(lane)`` (``lane``: ``REQUEST_CLASS_CRITICAL`` or
            ``REQUEST_CLASS_BULK``), called once on each lane's worker thread
            before it takes any request -- the critical lane's first, then the
            bulk lane's, never both at once (the model's warm-up: ONNX
            Runtime's CUDA execution provider keeps per-thread state); the
            constructor returns when both are done.
        executed: ``executed(batch, seconds)``, on the lane's worker after
            every run (failed ones too): the run's figures (metrics). Called
            before any of the batch's waiters is woken, so a reader after a
            reply finds them; in a batch whose requests the worker answers
            all itself (``on_written``), after those replies, off the
            clients' wait, and still before their waiters go on.

    Raises:
        ValueError: a non-positive size, a negative delay, unsorted buckets.
        Exception: whatever ``warm_up`` raised (every worker has then stopped).
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
        warm_up: Callable[[int], None] | None = None,
        executed: Callable[[Batch, float], None] | None = None,
    ):
        buckets = tuple(int(b) for b in buckets)
        if list(buckets) != sorted(set(buckets)) or any(b <= 0 for b in buckets):
            raise ValueError(f"buckets must be positive and strictly ascending, got {list(buckets)}")
        if max_batch_size <= 0 or max_queue_size <= 0 or max_queue_delay_us < 0:
            raise ValueError("max_batch_size and max_queue_size must be > 0, max_queue_delay_us >= 0")
        self._run, self._executed = run, executed
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
        self._lanes = {c: _Lane(c, self._lock) for c in LANES}  # the dict itself never changes
        self._queued = 0  # guarded by _lock: requests waiting in both lanes
        self._closed = False  # guarded by _lock
        self._bulk_share = 100  # guarded by _lock: percent of wall time the bulk lane may run
        self._warm_up = warm_up
        for lane in self._lanes.values():  # one warm-up at a time: critical, then bulk
            lane.thread = threading.Thread(target=self._loop, args=(lane,), name=f"batcher-{name}-{lane.name}",
                                           daemon=True)
            lane.thread.start()
            lane.warmed.wait()
            if lane.warm_up_error is not None:
                self.close()  # stops the lanes already serving
                raise lane.warm_up_error

    @property
    def threads(self) -> dict[str, threading.Thread]:
        """Lane name -> its worker thread."""
        return {lane.name: lane.thread for lane in self._lanes.values()}

    # -- the submitting side (gRPC threads) ------------------------------------

    def submit(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        request_class: int = BULK,
        deadline: Deadline | None = None,
        output_names: Sequence[str] = (),
        targets: dict | None = None,
        on_written: Callable[[Request], bool] | None = None,
        events=None,
    ) -> Request:
        """Queues a validated request in its class's lane and returns it (wait
        on it for the result).

        ``request_class``: ``reward_pb2.REQUEST_CLASS_CRITICAL`` or
        ``REQUEST_CLASS_BULK`` (the servicer maps UNSPECIFIED to bulk).
        ``targets``, ``on_written``, ``events``: see :class:`Request`.

        Raises:
            DeadlineExceeded: ``deadline`` has passed already.
            QueueFull: the queue is full and nothing may be shed for it.
            BatcherClosed: :meth:`close` was called.
            ValueError: ``rows`` < 1 or another ``request_class``.
        """
        if rows < 1:
            raise ValueError("rows must be >= 1")
        if request_class not in self._lanes:
            raise ValueError(
                f"request_class: expected REQUEST_CLASS_CRITICAL or REQUEST_CLASS_BULK, got {request_class}"
            )
        lane = self._lanes[request_class]
        now = self._clock()
        req = Request(feeds, rows, request_class, deadline, tuple(output_names), enqueued=now, targets=targets,
                      on_written=on_written if targets else None, events=events)
        if deadline is not None and deadline.passed(now):
            with self._lock:
                lane.stats["expired"] += 1
            raise DeadlineExceeded("deadline passed before the request was queued")
        victim = None
        with self._lock:
            if self._closed:
                raise BatcherClosed(f"model {self.name!r}: the reward service is stopping")
            if self._queued >= self.max_queue_size:
                bulk = self._lanes[BULK]
                if request_class != CRITICAL or not bulk.queue:
                    lane.stats["refused"] += 1
                    raise QueueFull(
                        f"model {self.name!r}: queue full ({self.max_queue_size} requests waiting); retry later"
                    )
                victim = bulk.queue.pop()  # the newest bulk request makes room for a critical one
                victim.state = DONE
                victim.error = QueueFull(f"model {self.name!r}: queue full; shed for a critical request")
                self._queued -= 1
                bulk.stats["shed"] += 1
            lane.queue.append(req)
            self._queued += 1
            lane.stats["submitted"] += 1
            lane.wake.notify()
        if victim is not None:
            victim._done.set()
        return req

    def set_bulk_share(self, percent: int) -> None:
        """The share of wall time (1..100 %; 0 counts as 100) the bulk lane may
        spend running batches (see the module's "Bulk share").

        Raises:
            ValueError: ``percent`` outside 0..100.
        """
        if not 0 <= percent <= 100:
            raise ValueError(f"bulk share: expected 0..100 percent, got {percent}")
        with self._lock:
            self._bulk_share = percent or 100
            self._lanes[BULK].wake.notify()  # a larger share may end the idle time at once

    @property
    def bulk_share(self) -> int:
        """The bulk lane's share of wall time, percent."""
        with self._lock:
            return self._bulk_share

    def take_latencies(self, request_class: int) -> list[float]:
        """Queue + model time (ms) of each request of ``request_class``'s lane
        answered since the previous call (at most the latest 4096), and forgets them."""
        lane = self._lanes[request_class]
        with self._lock:
            out = list(lane.latencies_ms)
            lane.latencies_ms.clear()
        return out

    def cancel(self, req: Request) -> bool:
        """Takes a still-queued request out of its lane's queue (its waiter gave
        up): it completes with DeadlineExceeded. False when it is running or done."""
        lane = self._lanes[req.request_class]
        with self._lock:
            if req.state != QUEUED:
                return False
            lane.queue.remove(req)
            self._queued -= 1
            req.state = DONE
            req.error = DeadlineExceeded("deadline passed while queued")
            lane.stats["expired"] += 1
        req._done.set()
        return True

    def evaluate(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        request_class: int = BULK,
        deadline: Deadline | None = None,
        output_names: Sequence[str] = (),
        targets: dict | None = None,
        on_written: Callable[[Request], bool] | None = None,
        events=None,
    ) -> Request:
        """:meth:`submit`, then waits until done or until ``deadline``.

        Returns the done request (``result()`` gives its outputs).

        Raises:
            DeadlineExceeded: the deadline passed first (a queued request is
                taken out of the queue and never run; a running one with
                ``targets`` or device feeds is waited for and returned, late).
            QueueFull, BatcherClosed, ValueError: as :meth:`submit`.
        """
        req = self.submit(feeds, rows, request_class, deadline, output_names, targets, on_written, events)
        while True:
            # Bounded waits: a far deadline must not overflow the platform's timeout type.
            timeout = None if deadline is None else min(deadline.wait_s(self._clock()), _MAX_WAIT_S)
            if req.wait(timeout):
                return req
            if deadline is not None and deadline.passed(self._clock()):
                if self.cancel(req):
                    raise DeadlineExceeded("deadline passed before the result was ready")
                if req.targets is not None or any(on_device(a) for a in req.feeds.values()):
                    # Running, and reading its device feeds or writing into its targets: the
                    # caller must not let go of that memory (a client's CUDA region, which its
                    # release may close) before the copies are done. A run is ms away.
                    req.wait()
                    return req
                if not req.wait(0.0):
                    raise DeadlineExceeded("deadline passed before the result was ready")
                return req

    def stats(self) -> dict:
        """Both lanes together: ``queued`` (requests waiting), ``oldest_age_ms``
        (0 when none) and the counters ``submitted``, ``batches``, ``expired``,
        ``shed``, ``refused``; and the same per lane under ``lanes``
        (``{"critical": {...}, "bulk": {...}}``; a shed request counts in the
        lane it was queued in, the bulk one); ``bulk_share_percent``."""
        with self._lock:
            now = self._clock()
            lanes = {
                lane.name: {"queued": len(lane.queue), "oldest_age_ms": lane.oldest_age_ms(now),
                            **{k: lane.stats[k] for k in _COUNTERS}}
                for lane in self._lanes.values()
            }
            queued, share = self._queued, self._bulk_share
        total = {k: sum(v[k] for v in lanes.values()) for k in _COUNTERS}
        return {"queued": queued, "oldest_age_ms": max(v["oldest_age_ms"] for v in lanes.values()), **total,
                "lanes": lanes, "bulk_share_percent": share}

    def close(self, timeout_s: float = 5.0) -> None:
        """Refuses new requests, lets each lane's worker run what is queued in
        its lane, joins both (``timeout_s`` each)."""
        with self._lock:
            self._closed = True
            for lane in self._lanes.values():
                lane.wake.notify_all()
        for lane in self._lanes.values():
            if lane.thread is not None and lane.thread is not threading.current_thread():
                lane.thread.join(timeout_s)

    # -- the workers, one per lane ----------------------------------------------

    def _loop(self, lane: _Lane) -> None:
        try:
            if self._warm_up is not None:
                self._warm_up(lane.request_class)
        except BaseException as exc:  # handed to the constructor, which raises it
            lane.warm_up_error = exc
            return
        finally:
            lane.warmed.set()
        while True:
            with self._lock:
                while True:
                    if not lane.queue:
                        if self._closed:
                            return
                        lane.wake.wait()
                        continue
                    wait_s = self._merge_wait_locked(lane)
                    if wait_s <= 0:
                        break
                    lane.wake.wait(wait_s)
                expired, batch = self._take_locked(lane)
            for req in expired:
                req._done.set()
            if batch is not None:
                timeline.mark("batch.taken")
                start = self._clock()
                self._execute(batch)
                end = self._clock()
                with self._lock:
                    lane.last_busy_s, lane.last_end = end - start, end
            # Let go of the answered requests now, not when the next batch comes: their
            # arrays may map a client's shared memory, which is closed once unreferenced.
            expired = batch = None

    def _merge_wait_locked(self, lane: _Lane) -> float:
        """Seconds ``lane``'s worker waits for more requests to merge with; <= 0:
        form a batch now (critical requests never wait)."""
        if self._closed or lane.request_class == CRITICAL:
            return 0.0
        if self._bulk_share < 100:  # the lever: idle in proportion to the last batch's run time
            idle_s = lane.last_end + lane.last_busy_s * (100.0 / self._bulk_share - 1.0) - self._clock()
            if idle_s > 0:
                return idle_s
        if sum(r.rows for r in lane.queue) >= self.max_rows:
            return 0.0
        return lane.queue[0].enqueued + self.max_queue_delay_s - self._clock()

    def _take_locked(self, lane: _Lane) -> tuple[list[Request], Batch | None]:
        """Drops ``lane``'s expired requests (returned, marked DONE) and takes
        its next batch from the head of its queue."""
        now = self._clock()
        expired = [r for r in lane.queue if r.deadline is not None and r.deadline.passed(now)]
        if expired:
            lane.queue = collections.deque(r for r in lane.queue if r.deadline is None or not r.deadline.passed(now))
            for r in expired:
                r.state = DONE
                r.error = DeadlineExceeded("deadline passed while queued")
            self._queued -= len(expired)
            lane.stats["expired"] += len(expired)
        taken: list[Request] = []
        offsets: list[int] = []  # each request's first row in the batch
        rows = 0
        q = lane.queue
        while q:
            req = q[0]
            if taken and (not self.merge or rows + req.rows > self.max_rows):
                break  # full: the rest go in the next batch
            q.popleft()
            self._queued -= 1
            taken.append(req)
            offsets.append(rows)
            rows += req.rows
            if rows > self.max_rows:  # a lone request larger than every bucket
                break
        if not taken:
            return expired, None
        for req in taken:
            req.state = RUNNING
        lane.stats["batches"] += 1
        bucket = bucket_for(rows, self.buckets) if rows <= self.max_rows else rows
        return expired, Batch(taken, rows, bucket, offsets, lane.request_class)

    def _execute(self, batch: Batch) -> None:
        start = self._clock()
        try:
            outputs = self._run(batch)
            error = None
        except Exception as exc:  # the model run failed: every request in it gets the error
            log.exception("model %s: %s batch of %d rows failed", self.name, LANES[batch.lane], batch.rows)
            outputs, error = None, exc
        compute_ms = (self._clock() - start) * 1e3
        for req, off in zip(batch.requests, batch.offsets):
            req.queue_ms = (start - req.enqueued) * 1e3
            req.compute_ms = compute_ms
            req.batch_rows, req.bucket = batch.rows, batch.bucket
            if error is None and (req.targets_written or req.inputs_late):
                req.outputs = {}  # in its targets already; or its inputs came late: its caller answers an error
            elif error is None:
                try:
                    names = req.output_names or tuple(outputs)
                    req.outputs = {n: outputs[n][off : off + req.rows] for n in names}
                except Exception as exc:  # e.g. an output without a batch dimension
                    log.exception("model %s: cannot split the batch's outputs", self.name)
                    req.error = exc
            else:
                req.error = error
        lane = self._lanes[batch.lane]
        with self._lock:
            for req in batch.requests:
                req.state = DONE
                lane.latencies_ms.append(req.queue_ms + compute_ms)
        answering, others = [], []  # the requests the worker answers itself, after the others are done
        for req in batch.requests:
            worker_answers = req.on_written is not None and req.targets_written and req.error is None
            (answering if worker_answers else others).append(req)
        if others:
            self._record(batch, compute_ms)  # the run's figures before any waiter wakes, as a reply follows
            timeline.mark("batch.done")
        for req in others:
            req._done.set()
        try:
            for req in answering:
                try:
                    req.answered = bool(req.on_written(req))
                except Exception:  # a bug: the waiter answers instead
                    log.exception("model %s: a request's on_written failed", self.name)
        finally:  # even past a BaseException: no waiter is left hanging
            if not others:
                self._record(batch, compute_ms)  # off the answered clients' wait, before their waiters go on
            for req in answering:
                req._done.set()

    def _record(self, batch: Batch, compute_ms: float) -> None:
        if self._executed is not None:
            try:
                self._executed(batch, compute_ms / 1e3)
            except Exception:  # figures lost, the lane goes on
                log.exception("model %s: recording a run failed", self.name)

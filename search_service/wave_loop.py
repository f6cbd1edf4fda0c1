"""The wave loop: every search in flight advances as one batch of trees.

Searches that share their constants (the game, the evaluator, K = ``parallel_sims``,
the exploration constants, the node limit: a *lane*) are the rows of one
:class:`~search_service.mcts.batch.TreeBatch`, stepped by one thread of
their own: each wave selects in every live tree, values all their leaves in
one model call (or one batch of rollouts) and backs them up. A search joins
at the next wave boundary and leaves when its own budget ends it (its
deadline, its simulation cap, its root proven, its caller gone): a ragged
batch (search_service/mcts/plan.py has the rules). A ``Search`` call is one
job; a ``SearchBatch`` call is K jobs submitted at once.

Admission (at :meth:`WaveLoop.submit`, on the caller's thread, answered at
once, never late): more trees in flight than ``max_trees``, or a deadline
shorter than the wave its lane is expected to run next once it has joined
(a search that cannot get one wave, the minimum useful search), is refused
with :class:`Refused` (RESOURCE_EXHAUSTED). A lane with no search in flight
admits any deadline: a lone search always gets its one wave, as a
backend's own ``search`` does.

Invariants (``_lock`` guards ``_in_flight`` and every lane's ``queue`` and
``closed``):

* a job is in exactly one place: a lane's ``queue`` (submitted, not joined),
  its lane's ``members`` (joined), or answered;
* only a lane's thread takes from its queue, and only it touches its batch,
  ``members`` and ``times``;
* a job is answered exactly once (a result and a tree, or an error), then
  its ``done`` event is set; ``_in_flight`` counts the jobs submitted and not
  yet answered;
* a job that leaves is answered before the lane's next wave runs (that wave
  is why it left: it would end past its deadline), and before newcomers
  join (a join costs time: the batch grows, PUCT roots are valued);
* a failure outside the model (an exception from the batch) fails every job
  joined to that lane's batch, which starts empty again; the jobs still
  queued join it, and the other lanes go on.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from search_service.mcts.backend import SearchParams, SearchResult
from search_service.mcts.batch import leave, run_wave
from search_service.mcts.plan import Member, WaveTimes, fair_share
from tandem.deadline import Deadline, earliest

log = logging.getLogger(__name__)

TREES = Gauge("tandem_search_batch_trees", "Searches in flight in the wave loop (joined or waiting to join).")
WAVE_TREES = Histogram("tandem_search_wave_trees", "Trees in one wave of the wave loop.",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
REFUSED = Counter("tandem_search_refused", "Searches refused at admission (RESOURCE_EXHAUSTED).", ["reason"])


class Stopping(RuntimeError):
    """The loop closed before the search was answered: the server answers UNAVAILABLE."""


class Refused(Exception):
    """A search the wave loop cannot serve usefully: the server answers
    RESOURCE_EXHAUSTED with this message."""


@dataclass(eq=False)  # compared by identity
class Job:
    """One search: a root (a batch of one position of ``params.game``), the
    tree to search further or None, its params (budget, seed, game), its
    caller's stop check and its deadline (None where ``params.deadline_ms``
    is None; not given: ``params.deadline_ms`` from the job's creation)."""

    roots: Any  # a batch of one position of params.game (Connect Four: Positions [1])
    tree: Any
    params: SearchParams
    should_stop: Callable[[], bool] | None = None
    stream: int = 0  # the tree's Philox tree word (its index within its own request)
    keep_tree: bool = True  # its tree comes back with its answer (False: no session keeps it; may be None)
    deadline: Deadline | None = None  # by when it answers
    done: threading.Event = field(default_factory=threading.Event)
    result: SearchResult | None = None
    out_tree: Any = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        if self.deadline is None and self.params.deadline_ms is not None:
            self.deadline = Deadline.after_ms(self.params.deadline_ms)

    def answer(self, result=None, tree=None, error: BaseException | None = None) -> None:
        self.result, self.out_tree, self.error = result, tree, error
        self.done.set()


def lane_key(params: SearchParams) -> SearchParams:
    """The constants a lane's searches share: ``params`` less their budget and
    seed (a nominal deadline stands for the members' own)."""
    return dataclasses.replace(params, simulations=None, deadline_ms=1.0, seed=0)


class _Lane:
    def __init__(self, key: SearchParams, batch):
        self.key = key  # lane_key: the constants its searches share
        self.batch = batch
        self.k_max = key.parallel_sims
        self.queue: list[Job] = []  # guarded by WaveLoop._lock
        self.members: list[Member] = []  # the lane's thread only; members[b] is row b
        # The lane's thread writes it; submit reads expected_ms (a snapshot).
        self.times = WaveTimes(sliced=batch.slice_ms is not None)
        self.thread: threading.Thread | None = None


class WaveLoop:
    """Runs submitted searches as batches of trees (module docstring).

    Args:
        backend: a backend with ``open_batch(params, evaluator)``.
        evaluator: the leaf evaluator of value-model searches; with an
            ``until(deadline)`` method (a :class:`~tandem.deadline.Deadline`)
            each wave's call is bound by the earliest deadline among its trees
            (never sooner than two expected waves away: ``_set_wave_deadline``).
        max_trees: searches in flight at most (joined or waiting); more are refused.
        wave_target_ms: deadline-only searches take fewer simulations a wave
            where a wave would take longer (plan.py); None: always K.
        launching: a context manager factory every wave runs inside (the
            CUDA stream of the scheduler's priority); None: none.
        lend: ``lend(deadline)`` -> a context manager of a device channel or
            None (search_service/evaluators.py HandoffEvaluator.lend), passed
            as ``lend()`` to backends whose ``open_batch`` takes it (a wave's
            leaves by the leaf channel's CUDA regions), bound by the wave's
            deadline; None: none.
        backend_for: ``backend_for(game)`` -> the backend whose batches a
            lane of that game's searches steps (search_service/backends.py
            GameBackends.for_game); None: ``backend`` for every game.
    """

    def __init__(self, backend, evaluator=None, max_trees: int = 1024, wave_target_ms: float | None = None,
                 launching: Callable[[], Any] | None = None, lend: Callable[[Deadline | None], Any] | None = None,
                 backend_for: Callable[[Any], Any] | None = None):
        self.backend = backend
        self.backend_for = backend_for or (lambda game: backend)
        self.evaluator = evaluator
        self.lend = lend
        self.max_trees = max_trees
        self.wave_target_ms = wave_target_ms
        self.launching = launching or nullcontext
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._lanes: dict[SearchParams, _Lane] = {}  # guarded by _lock
        self._in_flight = 0  # guarded by _lock
        self._closed = False  # guarded by _lock

    # -- the callers' side ------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queues ``jobs`` to join their lanes' batches at the next wave
        boundary; all or none.

        Raises:
            Refused: the loop is full (``max_trees``), or a job's deadline is
                shorter than its lane's next wave is expected to take.
            Stopping: the loop is closed.
        """
        with self._lock:
            if self._closed:
                raise Stopping("the search service is stopping")
            if self._in_flight + len(jobs) > self.max_trees:
                REFUSED.labels("full").inc(len(jobs))
                raise Refused(f"the search service is at capacity: {self._in_flight} searches in flight, "
                              f"{len(jobs)} more would pass search.max_trees ({self.max_trees})")
            lanes = [self._lane(job.params) for job in jobs]
            adding: dict[int, int] = {}  # id(lane) -> its jobs in this call
            for lane in lanes:
                adding[id(lane)] = adding.get(id(lane), 0) + 1
            now = Deadline.now()
            for job, lane in zip(jobs, lanes):
                busy = len(lane.members) + len(lane.queue)  # the lane thread's list: a racy length is enough here
                if not busy or job.deadline is None:
                    continue
                # Its lane's next wave with it, every member at K and then at its fair share (all taken
                # as deadline-only: the wave the plan would run at most).
                ks = np.full(busy + adding[id(lane)], lane.k_max, np.int64)
                expected = fair_share(ks, np.ones(ks.size, bool), lane.times, lane.k_max, self.wave_target_ms)
                left_ms = job.deadline.left_ms(now)
                if left_ms < expected:
                    REFUSED.labels("deadline").inc(len(jobs))
                    raise Refused(f"the search service is at capacity: its next wave is expected to take "
                                  f"{expected:.1f} ms, more than the {max(left_ms, 0):.1f} ms this search has left "
                                  f"of deadline_ms; answer sooner with a longer deadline or fewer searches")
            for job, lane in zip(jobs, lanes):
                lane.queue.append(job)
            self._in_flight += len(jobs)
            TREES.set(self._in_flight)
            self._wake.notify_all()

    def in_flight(self) -> int:
        """Searches submitted and not yet answered."""
        with self._lock:
            return self._in_flight

    def close(self) -> None:
        """Stops the lanes; jobs not yet answered fail with :class:`Stopping`."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            threads = [lane.thread for lane in self._lanes.values() if lane.thread is not None]
        for t in threads:
            t.join(5)

    def _lane(self, params: SearchParams) -> _Lane:  # caller holds _lock
        key = lane_key(params)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key, self._open(key))
            lane.thread = threading.Thread(target=self._run, args=(lane,), name=f"wave-loop-{key.evaluator}",
                                           daemon=True)
            lane.thread.start()
        return lane

    # -- the lane's thread --------------------------------------------------------
    _wave_deadline = threading.local()  # per lane thread: the Deadline the evaluator's call is bound by

    def _open(self, key: SearchParams):
        """A new batch of ``key``'s lane, on its game's backend (with a device
        channel lent a wave, where the backend takes one)."""
        backend = self.backend_for(key.game)
        if self.lend is not None and "lend" in inspect.signature(backend.open_batch).parameters:
            return backend.open_batch(key, self._bound_evaluator,
                                      lend=lambda: self.lend(getattr(self._wave_deadline, "value", None)))
        return backend.open_batch(key, self._bound_evaluator)

    def _bound_evaluator(self, observations):
        until = getattr(self.evaluator, "until", None)
        deadline = getattr(self._wave_deadline, "value", None)
        return (until(deadline) if until else self.evaluator)(observations)

    def _take(self, lane: _Lane) -> list[Job] | None:
        """The jobs queued for ``lane`` (waiting while it has none and no
        member); None once closed."""
        with self._lock:
            while not lane.queue and not lane.members and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            jobs, lane.queue = lane.queue, []
            return jobs

    def _answered(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n
            TREES.set(self._in_flight)

    def _run(self, lane: _Lane) -> None:
        try:
            while (jobs := self._take(lane)) is not None:
                if jobs and lane.members:  # those done are answered before the newcomers' join delays them
                    self._leave(lane)
                self._join(lane, jobs)
                if lane.members:
                    self._step(lane)
        finally:
            self._fail_all(lane, Stopping("the search service is stopping"), queued=True)

    def _join(self, lane: _Lane, jobs: list[Job]) -> None:
        """Joins ``jobs`` to the lane's batch: all in one call (one gather of
        the trees), or one by one where that fails, so a job that cannot join
        (answered with its error) costs only itself."""
        if not jobs:
            return
        self._set_wave_deadline([job.deadline for job in jobs], lane)
        try:
            with self.launching():
                self._join_all(lane, jobs)
        except Exception:  # noqa: BLE001 - the batch is as it was: find the job that cannot join
            for job in jobs:
                try:
                    with self.launching():
                        self._join_all(lane, [job])
                except Exception as exc:  # noqa: BLE001 - this job's alone
                    job.answer(error=exc)
                    self._answered(1)

    def _join_all(self, lane: _Lane, jobs: list[Job]) -> None:
        lane.batch.join(lane.key.game.stack([job.roots for job in jobs]), [job.tree for job in jobs],
                        [job.params.seed for job in jobs], [job.stream for job in jobs])
        lane.members += [Member(job.params.simulations, job.deadline, job.should_stop, owner=job,
                                keep_tree=job.keep_tree) for job in jobs]

    def _leave(self, lane: _Lane):
        """Plans the lane's next wave; the members that are done leave and are
        answered. Returns the wave's simulations per member (int64 [B]), or
        None where planning failed (every member failed with it)."""
        try:
            left, ks = leave(lane.batch, lane.members, lane.times, self.wave_target_ms)
        except Exception as exc:  # noqa: BLE001 - every job of the batch fails with it; the lane goes on empty
            log.exception("planning a wave of %d searches failed", len(lane.members))
            self._fail_all(lane, exc)
            return None
        for member, result, tree in left:
            member.owner.answer(result, tree)
        if left:
            self._answered(len(left))
        return ks

    def _step(self, lane: _Lane) -> None:
        """One step of the lane's batch: the members that are done leave and
        are answered, then the wave runs (its failure fails only its members).
        The wave's time, as the plan learns it, counts from the plan: what a
        member that stays waits for until the next plan can answer it."""
        WAVE_TREES.observe(len(lane.members))
        planned = time.perf_counter()
        ks = self._leave(lane)
        if ks is None or not lane.members:
            return
        self._set_wave_deadline([m.deadline for m in lane.members], lane)
        try:
            with self.launching():
                run_wave(lane.batch, lane.members, ks, lane.times, since=planned)
        except Exception as exc:  # noqa: BLE001 - every job of the batch fails with it; the lane goes on empty
            log.exception("a wave of %d searches failed", len(lane.members))
            self._fail_all(lane, exc)

    def _set_wave_deadline(self, deadlines: list[Deadline | None], lane: _Lane) -> None:
        """The evaluator's calls are bound by the earliest of ``deadlines``
        (None: none), so a stalled model holds no search past its own
        deadline; but never sooner than two of the lane's expected waves from
        now (a search with less time left was admitted alone)."""
        first = earliest(*deadlines)
        if first is None:
            self._wave_deadline.value = None
            return
        self._wave_deadline.value = max(first, Deadline.after_ms(
            2 * lane.times.expected_ms(len(lane.members) * lane.k_max)))

    def _fail_all(self, lane: _Lane, exc: BaseException, queued: bool = False) -> None:
        """Answers the lane's joined jobs (and, ``queued``, those waiting to join)
        with ``exc``; the lane goes on with an empty batch."""
        jobs = [m.owner for m in lane.members]
        if queued:
            with self._lock:
                jobs += lane.queue
                lane.queue = []
        lane.members.clear()
        lane.batch = self._open(lane.key)
        lane.times = WaveTimes(sliced=lane.times.sliced)
        for job in jobs:
            job.answer(error=exc)
        if jobs:
            self._answered(len(jobs))

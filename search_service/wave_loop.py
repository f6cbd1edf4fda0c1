"""The wave loop: every search in flight advances as one batch of trees.

Searches that share their constants (the game, the evaluator, K = ``parallel_sims``,
the exploration constants, the node limit: a *group*) are the rows of one
:class:`~search_service.mcts.batch.TreeBatch`, stepped by one thread of
their own: each wave selects in every live tree, values all their leaves in
one model call (or one batch of rollouts) and backs them up. A search joins
at the next wave boundary and leaves when its own budget ends it (its
deadline, its simulation cap, its root proven, its caller gone): a ragged
batch (search_service/mcts/plan.py has the rules). A ``Search`` call is one
job; a ``SearchBatch`` call is K jobs submitted at once.

Admission (at :meth:`WaveLoop.submit`, on the caller's thread, answered at
once, never late): more trees in flight than ``max_trees``, or a deadline
shorter than the wave its group is expected to run next once it has joined
(a search that cannot get one wave, the minimum useful search: for a fresh
value-model root, the wave that brings its priors, the policy's move), is refused
with :class:`Refused` (RESOURCE_EXHAUSTED). A group with no search in flight
admits any deadline: a lone search always gets its one wave, as a
backend's own ``search`` does.

Invariants (``_lock`` guards ``_in_flight`` and every group's ``queue`` and
``closed``):

* a job is in exactly one place: a group's ``queue`` (submitted, not joined),
  its group's ``members`` (joined), or answered;
* only a group's thread takes from its queue, and only it touches its batch,
  ``members`` and ``times``;
* a job is answered exactly once (a result and a tree, or an error), then
  its ``done`` event is set; ``_in_flight`` counts the jobs submitted and not
  yet answered;
* a job that leaves is answered before the group's next wave runs (that wave
  is why it left: it would end past its deadline), and before newcomers
  join (a join costs time: the batch grows);
* a failure outside the model (an exception from the batch) fails every job
  joined to that group's batch, which starts empty again; the jobs still
  queued join it, and the other groups go on.
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

from prometheus_client import Counter, Gauge, Histogram

from search_service.mcts.backend import SearchParams, SearchResult
from search_service.mcts.batch import leave, run_wave
from search_service.mcts.plan import Member, WaveTimes, next_wave_ms
from tandem.deadline import Deadline, earliest

log = logging.getLogger(__name__)

TREES = Gauge("tandem_search_batch_trees", "Searches in flight in the wave loop (joined or waiting to join).",
              multiprocess_mode="livesum")
WAVE_TREES = Histogram("tandem_search_wave_trees", "Trees in one wave of the wave loop.",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
WAVE_LEAVES = Histogram("tandem_search_wave_leaves", "Simulations a wave of the wave loop plans over all its trees "
                        "(value model: the leaves of its model call; sliced rollout waves and waves of roots "
                        "valued alone are not counted).",
                        buckets=(1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
WAVE_EXPECTED_SECONDS = Histogram("tandem_search_wave_expected_seconds", "How long a wave was expected to take as it "
                                  "ran (s): the batch's WaveTimes for its simulations, the estimate its plan used "
                                  "(waves that ran simulations).",
                                  buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3, 0.128))
LEFT = Counter("tandem_search_left", "Searches that left the batch, by why: budget (its simulation cap), proven, "
               "deadline (the next wave would end past it), stopped (cancelled), failed (its wave failed).", ["end"])
REFUSED = Counter("tandem_search_refused", "Searches refused at admission (RESOURCE_EXHAUSTED), by why: full "
                  "(search.max_trees), deadline (shorter than the next wave), spent (the call arrived with no time "
                  "left for a search while others were in flight; refused before it was validated).", ["reason"])
PHASE_SECONDS = Histogram(
    "tandem_search_wave_phase_seconds",
    "Time of one step of a group's thread (s): join (newcomers join the batch), leave (plan the wave, answer "
    "those done), wave (select, value, back up), roots (a wave with no simulation: fresh roots valued alone).",
    ["phase"], buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 16e-3, 32e-3, 64e-3, 0.128, 0.256))
JOIN_LEFT_SECONDS = Histogram(
    "tandem_search_join_left_seconds", "Time left before a search's deadline as it joins the batch (s; at most 0: "
    "it arrived spent, and its answer comes from at most one wave): how late the calls reach the wave loop.",
    buckets=(-0.016, -0.008, -0.004, -0.002, -0.001, 0.0, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.1, 1.0, 10.0))


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


def group_key(params: SearchParams) -> SearchParams:
    """The constants a group's searches share: ``params`` less their budget and
    seed (a nominal deadline stands for the members' own)."""
    return dataclasses.replace(params, simulations=None, deadline_ms=1.0, seed=0)


# SearchParams' fields that group_key keeps: a search's group is found by their values (a
# dict lookup, not a dataclass built and validated per search).
_SHARED = tuple(f.name for f in dataclasses.fields(SearchParams) if f.name not in ("simulations", "deadline_ms", "seed"))


class _Group:
    def __init__(self, key: SearchParams, batch):
        self.key = key  # group_key: the constants its searches share
        self.batch = batch
        self.k_max = key.parallel_sims
        self.queue: list[Job] = []  # guarded by WaveLoop._lock
        self.members: list[Member] = []  # the group's thread only; members[b] is row b
        # The group's thread writes it; submit reads expected_ms (a snapshot).
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
            group of that game's searches steps (search_service/backends.py
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
        self._groups: dict[tuple, _Group] = {}  # by the values of _SHARED; guarded by _lock
        self._in_flight = 0  # guarded by _lock
        self._closed = False  # guarded by _lock

    # -- the callers' side ------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queues ``jobs`` to join their groups' batches at the next wave
        boundary; all or none.

        Raises:
            Refused: the loop is full (``max_trees``), or a job's deadline is
                shorter than its group's next wave is expected to take.
            Stopping: the loop is closed.
        """
        with self._lock:
            if self._closed:
                raise Stopping("the search service is stopping")
            if self._in_flight + len(jobs) > self.max_trees:
                REFUSED.labels("full").inc(len(jobs))
                raise Refused(f"the search service is at capacity: {self._in_flight} searches in flight, "
                              f"{len(jobs)} more would pass search.max_trees ({self.max_trees})")
            groups = [self._lane(job.params) for job in jobs]
            now = Deadline.now()
            expect: dict[int, float] = {}  # id(group) -> its next wave with this call's jobs, ms
            for job, group in zip(jobs, groups):
                busy = len(group.members) + len(group.queue)  # the group thread's list: a racy length is enough here
                if not busy or job.deadline is None:
                    continue
                left_ms = job.deadline.left_ms(now)
                if id(group) not in expect:  # its group's next wave with them, at most
                    caps = [m.simulations for m in list(group.members)]  # a copy: the group thread's list
                    caps += [j.params.simulations for j in group.queue + [j for j, g in zip(jobs, groups)
                                                                           if g is group]]
                    capped = sum(c is not None for c in caps)
                    expect[id(group)] = next_wave_ms(len(caps) - capped, capped, group.times, group.k_max,
                                                     self.wave_target_ms)
                expected = expect[id(group)]
                if left_ms < expected:
                    REFUSED.labels("deadline").inc(len(jobs))
                    raise Refused(f"the search service is at capacity: its next wave is expected to take "
                                  f"{expected:.1f} ms, more than the {max(left_ms, 0):.1f} ms this search has left "
                                  f"of deadline_ms; answer sooner with a longer deadline or fewer searches")
            for job, group in zip(jobs, groups):
                group.queue.append(job)
            self._in_flight += len(jobs)
            TREES.set(self._in_flight)
            self._wake.notify_all()

    def in_flight(self) -> int:
        """Searches submitted and not yet answered."""
        with self._lock:
            return self._in_flight

    def close(self) -> None:
        """Stops the groups; jobs not yet answered fail with :class:`Stopping`."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            threads = [group.thread for group in self._groups.values() if group.thread is not None]
        for t in threads:
            t.join(5)

    def _lane(self, params: SearchParams) -> _Group:  # caller holds _lock
        shared = tuple(getattr(params, name) for name in _SHARED)
        group = self._groups.get(shared)
        if group is None:
            key = group_key(params)
            group = self._groups[shared] = _Group(key, self._open(key))
            group.thread = threading.Thread(target=self._run, args=(group,), name=f"wave-loop-{key.evaluator}",
                                           daemon=True)
            group.thread.start()
        return group

    # -- the group's thread --------------------------------------------------------
    _wave_deadline = threading.local()  # per group thread: the Deadline the evaluator's call is bound by

    def _open(self, key: SearchParams):
        """A new batch of ``key``'s group, on its game's backend (with a device
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

    def _take(self, group: _Group) -> list[Job] | None:
        """The jobs queued for ``group`` (waiting while it has none and no
        member); None once closed."""
        with self._lock:
            while not group.queue and not group.members and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            jobs, group.queue = group.queue, []
            return jobs

    def _answered(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n
            TREES.set(self._in_flight)

    def _run(self, group: _Group) -> None:
        try:
            while (jobs := self._take(group)) is not None:
                if jobs and group.members:  # those done are answered before the newcomers' join delays them
                    self._leave(group)
                self._join(group, jobs)
                if group.members:
                    self._step(group)
        finally:
            self._fail_all(group, Stopping("the search service is stopping"), queued=True)

    def _join(self, group: _Group, jobs: list[Job]) -> None:
        """Joins ``jobs`` to the group's batch: all in one call (one gather of
        the trees), or one by one where that fails, so a job that cannot join
        (answered with its error) costs only itself."""
        if not jobs:
            return
        self._set_wave_deadline([job.deadline for job in jobs], group)
        now = Deadline.now()
        for job in jobs:
            if job.deadline is not None:
                JOIN_LEFT_SECONDS.observe(job.deadline.left_s(now))
        try:
            with self.launching(), PHASE_SECONDS.labels("join").time():
                self._join_all(group, jobs)
        except Exception:  # noqa: BLE001 - the batch is as it was: find the job that cannot join
            for job in jobs:
                try:
                    with self.launching():
                        self._join_all(group, [job])
                except Exception as exc:  # noqa: BLE001 - this job's alone
                    job.answer(error=exc)
                    self._answered(1)

    def _join_all(self, group: _Group, jobs: list[Job]) -> None:
        group.batch.join(group.key.game.stack([job.roots for job in jobs]), [job.tree for job in jobs],
                        [job.params.seed for job in jobs], [job.stream for job in jobs])
        group.members += [Member(job.params.simulations, job.deadline, job.should_stop, owner=job,
                                keep_tree=job.keep_tree) for job in jobs]

    def _leave(self, group: _Group):
        """Plans the group's next wave; the members that are done leave and are
        answered. Returns the wave's simulations per member (int64 [B]), or
        None where planning failed (every member failed with it)."""
        try:
            left, ks = leave(group.batch, group.members, group.times, self.wave_target_ms)
        except Exception as exc:  # noqa: BLE001 - every job of the batch fails with it; the group goes on empty
            log.exception("planning a wave of %d searches failed", len(group.members))
            self._fail_all(group, exc)
            return None
        for member, result, tree in left:
            LEFT.labels(member.end or "failed").inc()
            member.owner.answer(result, tree)
        if left:
            self._answered(len(left))
        return ks

    def _step(self, group: _Group) -> None:
        """One step of the group's batch: the members that are done leave and
        are answered, then the wave runs (its failure fails only its members).
        The wave's time, as the plan learns it, counts from the plan: what a
        member that stays waits for until the next plan can answer it."""
        WAVE_TREES.observe(len(group.members))
        planned = time.perf_counter()
        ks = self._leave(group)
        PHASE_SECONDS.labels("leave").observe(time.perf_counter() - planned)
        if ks is None or not group.members:
            return
        self._set_wave_deadline([m.deadline for m in group.members], group)
        simulated = bool(ks.any())  # else a wave of fresh roots valued alone: its own phase, no plan to count
        if simulated:
            if group.batch.slice_ms is None:  # a sliced wave's simulations are known after it (plan.OPEN before)
                WAVE_LEAVES.observe(int(ks.sum()))
            WAVE_EXPECTED_SECONDS.observe(group.times.expected_ms(int(ks.sum())) / 1e3)
        try:
            with self.launching(), PHASE_SECONDS.labels("wave" if simulated else "roots").time():
                run_wave(group.batch, group.members, ks, group.times, since=planned)
        except Exception as exc:  # noqa: BLE001 - every job of the batch fails with it; the group goes on empty
            log.exception("a wave of %d searches failed", len(group.members))
            self._fail_all(group, exc)

    def _set_wave_deadline(self, deadlines: list[Deadline | None], group: _Group) -> None:
        """The evaluator's calls are bound by the earliest of ``deadlines``
        (None: none), so a stalled model holds no search past its own
        deadline; but never sooner than two of the group's expected waves from
        now (a search with less time left was admitted alone)."""
        first = earliest(*deadlines)
        if first is None:
            self._wave_deadline.value = None
            return
        self._wave_deadline.value = max(first, Deadline.after_ms(
            2 * group.times.expected_ms(len(group.members) * group.k_max)))

    def _fail_all(self, group: _Group, exc: BaseException, queued: bool = False) -> None:
        """Answers the group's joined jobs (and, ``queued``, those waiting to join)
        with ``exc``; the group goes on with an empty batch."""
        jobs = [m.owner for m in group.members]
        if queued:
            with self._lock:
                jobs += group.queue
                group.queue = []
        group.members.clear()
        group.batch = self._open(group.key)
        group.times = WaveTimes(sliced=group.times.sliced)
        for job in jobs:
            job.answer(error=exc)
        if jobs:
            self._answered(len(jobs))

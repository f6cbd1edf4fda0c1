"""Planning the waves of a batch of trees: how many simulations each tree takes
in the next wave, and which searches leave the batch before it.

A batch holds B trees, one per search in flight; every search has its own
budget (a simulation cap, a deadline, a stop check) and joins or leaves the
batch between waves, whoever else is in it (a ragged batch). Planning is a
pure function of the members' budgets, the trees' completed simulations and
the batch's recent wave times, so the CPU reference, the CUDA backend and the
search service's wave loop (search_service/wave_loop.py) share it.

Rules (per member, in this order; the CPU reference's single-search rules,
per tree):

0. its tree is not ready (a fresh PUCT root waiting for its priors, which
   the next wave's model call brings with that wave's leaves): it takes no
   simulation, and rules 3 and 4 wait for that wave (its first: once its
   root is valued it can answer, with the policy's move);
1. its root is proven: it leaves (``END_PROVEN``);
2. its simulation cap is reached: it leaves (``END_BUDGET``); else it takes
   ``k = min(K, cap - done)`` simulations (K = ``parallel_sims``);
3. once it has taken part in a wave (completed or undone), it leaves before a
   wave expected to end past its deadline (``END_DEADLINE``): at least one
   wave always runs;
4. once it has taken part in a wave, its ``should_stop()`` returning true
   makes it leave (``END_STOPPED``; each distinct callable is called once per
   plan: it takes a lock in gRPC).

A *sliced* batch (``batch.slice_ms`` set: rollout waves, which need no
model call between their simulations) runs each wave for a time slice
instead of a number of simulations: searches bounded by a deadline alone
take ``OPEN`` simulations (as many as the slice holds), capped ones what is
left of their cap, and the wave ends when the slice does (the CUDA kernel
checks the clock between a warp's simulations; the CPU reference between
waves of K). Every wave then takes about the slice, so its expected time is
the longest recent one and the fair share does not apply.

How long the next wave will take: :class:`WaveTimes`, a fixed cost per wave
plus a cost per simulation, learnt from the recent waves. Searches bounded by a
deadline alone (no simulation cap) share the GPU fairly under load: where the
wave at K each would take longer than ``wave_target_ms``, each of them takes
the same smaller k, so waves stay short, every member gets several of them in
its frame and newcomers join soon. Only the cost per simulation can be cut
so: a wave is never cut below twice its fixed cost (where the fixed cost, a
model call's round trip, is most of the wave, fewer simulations would save
little time and lose most of the work). The deadline-only searches' share
grows a wave to at most twice the largest one in the history, so a batch that
grew at once learns its cost per simulation from a wave of twice the leaves
instead of extrapolating to a wave of unknown length. Searches with
a simulation cap always take K (their trees equal the same search run alone,
whatever shares the batch).
"""
from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from tandem.deadline import Deadline

END_BUDGET, END_PROVEN, END_DEADLINE, END_STOPPED = "budget", "proven", "deadline", "stopped"
OPEN = 1 << 20  # a sliced wave's simulations for a search bounded by its deadline alone: the slice ends it
STALL_RATIO = 1.5  # a recent wave this many times longer than the next longest is a stall (WaveTimes)


@dataclass
class Member:
    """One search's budget in a batch of trees (one tree).

    ``deadline``: by when it answers (None: none);
    ``simulations`` caps the simulations this search runs (None: none).
    """

    simulations: int | None
    deadline: Deadline | None
    should_stop: Callable[[], bool] | None = None
    tried: bool = False  # took part in a wave, completed or undone
    end: str = ""  # why it left (END_*), once it has
    owner: Any = None  # whoever waits for its answer (the wave loop's job)
    keep_tree: bool = True  # its tree goes back with its answer (a session keeps it); False: a batch may skip the copy


class WaveTimes:
    """The batch's recent waves, as (leaves, ms), and what the next one is
    expected to take: a fixed cost per wave plus a cost per leaf.

    * ``overhead``: the quickest of the last ``history`` waves (launches, the
      model call's round trip);
    * ``per_leaf``: a resistant line (Tukey, *Exploratory Data Analysis*,
      1977) through the last ``history`` waves that ran simulations (a wave
      of roots valued alone has no selection or backup: its cost, of another
      kind, would read as a cost per leaf): the waves of more than half the most leaves
      (large) against the others (small), ms over leaves between the groups'
      medians (the large group's lower median: a stall among two does not
      count), never below 0. Where no wave has half the most leaves or fewer,
      0: waves of about one size cannot tell a cost per leaf from the jitter
      of the fixed cost (``(ms - quickest) / leaves``, the estimate before,
      read a 1 ms jitter in waves of 14 leaves as 0.07 ms a leaf; the fair
      share then cut every wave small, which kept the estimate high: 8
      engines on an H100, 2026-12-06, decision 0019); there the cost per leaf
      last fitted across sizes stays (waves cut to one size by the fair share
      keep the cost that cut them). A lone first wave of a batch that grew
      sets it, stalled or not (members leave early, none late), until larger
      waves follow or it leaves the history;
    * ``fixed``: each of the last ``window`` waves moved by ``per_leaf`` to
      zero leaves; the longest of them, but where it is more than
      ``STALL_RATIO`` times the next it is forgiven (up to ``forgive`` of
      them): one stall, a first call of a new batch size or a collection,
      does not hold every member to a wave that long for the next ``window``
      waves (they would leave after one wave each, and newcomers be
      refused), while ordinary jitter counts in full;
    * a wave of ``leaves``: ``fixed + per_leaf * leaves``, never under
      ``overhead``;
    * ``largest``: the most leaves of a wave in the history, of either kind:
      the fair share grows waves to at most twice it (:func:`shared_k`), so
      the cost of more leaves is measured before it is relied on.

    A search alone (the same leaves every wave) is so expected to take its
    longest recent wave (but a stall), the CPU reference's rule.

    ``sliced``: the waves of a sliced batch, which last a time slice whatever
    their simulations: every wave counts as one leaf, so the next is expected
    to take the longest recent one (but a stall).

    One thread adds (the wave loop's group thread), refitting the model
    then; other threads (admission) may call :meth:`expected_ms`, a few µs:
    ``_lock`` guards the recent waves and the fit (copying a deque while
    another thread appends to it raises)."""

    def __init__(self, window: int = 8, history: int = 32, sliced: bool = False, forgive: int = 1):
        self.sliced = sliced
        self.forgive = forgive
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # guarded by _lock
        self._history: deque[tuple[int, float, bool]] = deque(maxlen=history)  # (leaves, ms, simulated): the adding thread's only
        self._fit = (0.0, 0.0, 0.0)  # guarded by _lock: (overhead, fixed, per_leaf), refitted at each add
        self._largest = 0  # guarded by _lock: the most leaves of a wave in the history (0: none yet)
        self._known = 0.0  # the adding thread's only: the cost per leaf last fitted across sizes

    def add(self, leaves: int, ms: float, simulated: bool = True) -> None:
        """Records a wave of ``leaves`` simulations that took ``ms`` (undone
        waves too). ``simulated`` False: a wave of roots valued alone (no
        selection, no backup: another kind of wave; on the GPU not the
        cheaper), which counts for the quickest and the recent waves but not
        for the cost per leaf."""
        wave = (1 if self.sliced else max(int(leaves), 1), float(ms))
        self._history.append((*wave, simulated))
        overhead = min(t for _, t, _ in self._history)
        fitted = _slope([(n, t) for n, t, simulated in self._history if simulated])
        if fitted is not None:  # the history spans sizes: refit
            self._known = fitted
        per_leaf = self._known  # else (waves of one size, as the fair share cuts them): the last fit
        largest = max(n for n, _, _ in self._history)
        with self._lock:
            self._recent.append(wave)
            moved = sorted((t - per_leaf * n for n, t in self._recent), reverse=True)
            i = 0
            while i < min(self.forgive, len(moved) - 1) and moved[i] > STALL_RATIO * max(moved[i + 1], 0.0):
                i += 1
            self._fit = (overhead, moved[i], per_leaf)
            self._largest = largest

    def line(self) -> tuple[float, float]:
        """(fixed ms, ms per leaf): a wave of n leaves is expected to take
        ``max(overhead, fixed + per_leaf * n)`` (n is 1 for every sliced wave); (0, 0) before any wave."""
        with self._lock:
            _, fixed, per_leaf = self._fit
        return fixed, per_leaf

    def largest(self) -> int:
        """The most leaves of a wave in the history, roots valued alone included (0 before any wave)."""
        with self._lock:
            return self._largest

    def expected_ms(self, leaves: int) -> float:
        """ms a wave of ``leaves`` simulations is expected to take; 0 before any wave."""
        with self._lock:
            seen, (overhead, fixed, per_leaf) = bool(self._recent), self._fit
        if not seen:
            return 0.0
        n = 1 if self.sliced else max(int(leaves), 1)
        return max(overhead, fixed + per_leaf * n)


def _slope(waves: list[tuple[int, float]]) -> float | None:
    """ms per leaf of ``waves`` ((leaves, ms)): WaveTimes' ``per_leaf``; None
    where no wave has half the most leaves or fewer (or there is none)."""
    half = max((n for n, _ in waves), default=0) / 2
    small = [w for w in waves if w[0] <= half]
    large = [w for w in waves if w[0] > half]
    if not small:
        return None
    n_small, t_small = statistics.median(n for n, _ in small), statistics.median(t for _, t in small)
    n_large, t_large = statistics.median(n for n, _ in large), statistics.median_low(t for _, t in large)
    return max((t_large - t_small) / (n_large - n_small), 0.0)


@dataclass
class Plan:
    """The next wave: ``ks`` int64 [B] simulations per tree (0: none this
    wave), and the rows that leave before it (their members' ``end`` set)."""

    ks: np.ndarray
    leaving: list[int]


def _aim_ms(times: WaveTimes, wave_target_ms: float) -> float:
    """What a cut wave aims at (ms): the target, or twice the fixed cost where that is longer."""
    return max(wave_target_ms, 2 * times.line()[0])


def shared_k(shared: int, others: int, times: WaveTimes, k_max: int, wave_target_ms: float | None) -> int:
    """The simulations each of ``shared`` deadline-only members takes in a
    wave beside ``others`` leaves (capped members' simulations, waiting
    roots): ``k_max``, or less where the wave would take longer than
    ``wave_target_ms`` (or twice its fixed cost, where that is longer), and
    never so many that the wave holds more than twice the leaves of the
    largest in the history (module docstring). Scalar arithmetic: admission
    asks it per call."""
    if wave_target_ms is None or shared <= 0:
        return k_max
    fixed, per_leaf = times.line()
    # Never past twice the largest wave seen: the cost of more leaves is not extrapolated.
    largest = times.largest()
    cap = max(1, (2 * largest - others) // shared) if largest else k_max
    if per_leaf <= 0 or times.expected_ms(shared * k_max + others) <= wave_target_ms:
        return min(k_max, cap)
    longest = _aim_ms(times, wave_target_ms)
    room = (longest - fixed) / per_leaf - others  # leaves the shared ones may take
    if room >= shared:
        return min(k_max, cap, math.floor(room / shared))
    # The others' leaves alone fill the wave: it runs long whatever the shared ones take, and one
    # simulation each would save little of it and lose most of their work. They are cut in
    # proportion to the whole wave instead.
    return min(cap, max(1, math.floor(k_max * longest / times.expected_ms(shared * k_max + others))))


def next_wave_ms(shared: int, capped: int, times: WaveTimes, k_max: int, wave_target_ms: float | None) -> float:
    """The longest the next wave of ``shared`` deadline-only and ``capped``
    searches is expected to take (ms; admission's estimate): the capped ones
    at K (the plan never cuts them), the others at :func:`shared_k`; where
    that cuts, no less than the cut aims at (capped searches below K leave
    the others more room than K counts), unless the wave at K is shorter."""
    k = shared_k(shared, capped * k_max, times, k_max, wave_target_ms)
    cut = times.expected_ms(shared * k + capped * k_max)
    if k == k_max:
        return cut
    return max(cut, min(times.expected_ms((shared + capped) * k_max), _aim_ms(times, wave_target_ms)))


def fair_share(ks: np.ndarray, shared: np.ndarray, times: WaveTimes, k_max: int,
               wave_target_ms: float | None, roots: int = 0) -> float:
    """Shrinks, in place, the simulations ``ks`` (int64 [B]) of the members
    ``shared`` (bool [B]: bounded by a deadline alone) to one equal k
    (:func:`shared_k`); returns the wave's expected ms after it. ``roots``:
    rows the wave's model call values besides (roots waiting for their
    priors), counted as leaves."""
    n = int(np.count_nonzero(shared))
    if n:
        k = shared_k(n, int(ks[~shared].sum()) + roots, times, k_max, wave_target_ms)
        if k < k_max:
            ks[shared] = np.minimum(ks[shared], k)
    return times.expected_ms(int(ks.sum()) + roots)


def plan_wave(members: list[Member], done: np.ndarray, live: np.ndarray, times: WaveTimes, k_max: int,
              wave_target_ms: float | None = None, now: float | None = None, sliced: bool = False,
              ready: np.ndarray | None = None) -> Plan:
    """Plans the next wave of a batch (module docstring's rules).

    Args:
        members: B members, row b's budget.
        done: int [B], simulations completed per tree.
        live: bool [B], trees whose root is not proven.
        times: the batch's recent waves.
        k_max: K, simulations per tree per wave (>= 1).
        wave_target_ms: the longest a wave should take where deadline-only
            members can take fewer simulations (None: no target).
        now: ``time.monotonic()`` s, the deadlines' clock (None: read it).
        sliced: the batch's waves last a time slice (module docstring):
            deadline-only members take ``OPEN``, capped ones the rest of
            their cap, and no fair share applies.
        ready: bool [B], trees that can take simulations (rule 0; None: all).

    Returns:
        The plan; a member that leaves gets its ``end``.
    """
    now = Deadline.now() if now is None else now
    b = len(members)
    ks = np.zeros(b, np.int64)
    leaving: list[int] = []

    def leave(i: int, end: str) -> None:
        members[i].end, ks[i] = end, 0
        leaving.append(i)

    for i, m in enumerate(members):
        if not live[i]:
            leave(i, END_PROVEN)
        elif m.simulations is not None and done[i] >= m.simulations:
            leave(i, END_BUDGET)
        elif ready is None or ready[i]:
            wave = OPEN if sliced else k_max
            ks[i] = wave if m.simulations is None else min(wave, m.simulations - int(done[i]))
    asked: dict[int, bool] = {}  # id(should_stop) -> its answer: one call per plan
    for i, m in enumerate(members):
        if ks[i] and m.tried and m.should_stop is not None:
            key = id(m.should_stop)
            if key not in asked:
                asked[key] = bool(m.should_stop())
            if asked[key]:
                leave(i, END_STOPPED)
    # The deadline, against the wave as planned (its fair shares included); those
    # that leave only shorten it.
    shared = np.array([m.simulations is None for m in members], bool)
    waiting = 0 if ready is None else int(np.count_nonzero(~ready))  # the roots the wave's call values too
    expected = fair_share(ks, shared & (ks > 0), times, k_max, None if sliced else wave_target_ms, waiting)
    for i, m in enumerate(members):
        if ks[i] and m.tried and m.deadline is not None and m.deadline.left_ms(now) <= expected:
            leave(i, END_DEADLINE)
    return Plan(ks, sorted(leaving))

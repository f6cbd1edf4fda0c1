"""A batch of trees that searches join and leave between waves, and the one
step that advances it.

A backend that batches trees across searches offers ``open_batch(params,
evaluator)`` returning a :class:`TreeBatch`: B trees, one per search in
flight (rows), each with its own Philox key (``seed``) and tree index
(``stream``: the tree's index within its own request, so its rollouts draw
the numbers they would draw if that request ran alone). :func:`step` plans a
wave (:mod:`search_service.mcts.plan`), lets the members that are done leave
(:func:`leave`), and runs the wave over the rest (:func:`run_wave`); the
search service's wave loop does the same forever, answering the leavers
before the wave and admitting newcomers between steps; a backend's own
``search`` steps until its members are gone (:func:`search_alone`).

Independence: a tree's selections, expansions and backups read and write
its own rows only, and its rollouts draw from (seed, stream, simulation); so
at a fixed simulation cap and seed a tree searched beside others equals the
same search run alone (the tests check it), except for what the value model
answers (one call values every tree's leaves; a model whose answer for a row
depends on the other rows breaks it) and for a wave the model failed (every
tree that used the model in it undoes it; the trees on rollouts keep theirs).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from search_service.mcts.plan import END_DEADLINE, END_STOPPED, Member, WaveTimes, plan_wave

if TYPE_CHECKING:
    from search_service.games.connect4 import Positions
    from search_service.mcts.backend import SearchResult


class TreeBatch(Protocol):
    """B trees searched wave by wave (rows ``0 .. B-1``, in the order they joined)."""

    k_max: int  # K: simulations per tree per wave (the params' parallel_sims)
    # ms a wave lasts in a sliced batch (search_service/mcts/plan.py: rollout waves), its
    # ks[b] then an upper bound (math.inf: untimed, each tree runs its ks[b]: a CUDA
    # search() call's one launch); None: a wave runs exactly ks[b] simulations in tree b.
    slice_ms: float | None

    def __len__(self) -> int:
        """B, the trees in the batch."""
        ...

    @property
    def done(self) -> np.ndarray:
        """int64 [B]: simulations completed per tree since it joined."""
        ...

    def live(self) -> np.ndarray:
        """bool [B]: trees whose root is not proven."""
        ...

    def ready(self) -> np.ndarray:
        """bool [B]: trees that can take simulations; False: a fresh PUCT
        root whose priors the next wave's model call brings (plan.py, rule 0)."""
        ...

    def failed(self) -> np.ndarray:
        """bool [B]: trees the value model failed for (an undone wave, or a
        root it could not value): that took their time, as a wave does."""
        ...

    def join(self, roots: "Positions", trees: list, seeds: list[int], streams: list[int]) -> None:
        """Appends one tree per root (rows B .. B + len(roots) - 1): ``trees[i]``
        (a single tree rooted at ``roots[i]``, searched further; copied) or a
        fresh one (None, or a tree built with another evaluator). PUCT roots
        that have never been evaluated join not :meth:`ready`: the next
        wave's model call values them (their priors) with that wave's
        leaves, so a join costs no model call of its own.

        Raises:
            ValueError: a finished root or a tree rooted elsewhere (nothing joins).
        """
        ...

    def wave(self, ks: np.ndarray) -> bool:
        """One wave: ``ks[b]`` simulations in tree b (int64 [B], 0: none; a
        sliced batch: at most ``ks[b]``, in waves of K until ``slice_ms`` has passed).
        False if the value model could not value it: the wave is undone in
        every tree (as if it never ran) and the trees that used the model go
        on with rollouts (their results' ``evaluation_failure`` says why).
        The same model call values the roots of the trees not :meth:`ready`
        (``ks`` 0 there), which are ready after it (uniform priors and
        rollouts where it failed); a wave of no simulations values those
        roots alone."""
        ...

    def leave(self, rows: list[int], members: list[Member]) -> "tuple[list[SearchResult], list, np.ndarray]":
        """Removes ``rows`` (ascending) from the batch: their results (fields
        per tree; ``members[i].end`` says whether a deadline or a stop ended
        row ``rows[i]``), their trees, single and compact, for reuse, and the
        rows left, in their new order (int [B']: new row r was row
        ``kept[r]``; a batch may move rows to fill the holes). A member whose
        ``keep_tree`` is false may get None for its tree."""
        ...


def leave(batch: TreeBatch, members: list[Member], times: WaveTimes,
          wave_target_ms: float | None = None) -> "tuple[list[tuple[Member, SearchResult, object]], np.ndarray]":
    """Plans the next wave of ``batch`` (``members[b]``: row b's budget) and
    lets the members that are done leave (removed from ``members`` and the
    batch). Returns (member, result, tree) of each member that left, in row
    order, and the wave's simulations per remaining tree (int64 [B'])."""
    for m, failed in zip(members, batch.failed()):
        m.tried = m.tried or bool(failed)
    plan = plan_wave(members, batch.done, batch.live(), times, batch.k_max, wave_target_ms,
                     sliced=batch.slice_ms is not None, ready=batch.ready())
    left = []
    if plan.leaving:
        gone = [members[i] for i in plan.leaving]
        results, trees, kept = batch.leave(plan.leaving, gone)
        left = list(zip(gone, results, trees))
        members[:] = [members[i] for i in kept]
        plan.ks = plan.ks[kept]
    return left, plan.ks


def run_wave(batch: TreeBatch, members: list[Member], ks: np.ndarray, times: WaveTimes,
             since: float | None = None) -> None:
    """Runs the wave ``ks`` (from :func:`leave`) over ``batch``, timed into
    ``times`` from ``since`` (``time.perf_counter()`` s; None: the wave's start).
    A wave of no simulations runs where roots wait for their priors; each
    such root counts as one leaf in ``times`` (a row of the model call), and
    its member has then taken part in a wave (``tried``: plan rules 3, 4)."""
    roots = ~batch.ready()
    waiting = int(np.count_nonzero(roots))
    if not ks.any() and not waiting:
        return
    t = time.perf_counter() if since is None else since
    batch.wave(ks)
    times.add(int(ks.sum()) + waiting, (time.perf_counter() - t) * 1e3, simulated=bool(ks.any()))
    # A root valued in this wave took part in it: its search can answer (the policy's move), so
    # the plan's deadline rule applies to it from now on (a fresh value-model search needs one wave).
    for m, k, root in zip(members, ks, roots):
        m.tried = m.tried or bool(k) or bool(root)


def step(batch: TreeBatch, members: list[Member], times: WaveTimes,
         wave_target_ms: float | None = None) -> "list[tuple[Member, SearchResult, object]]":
    """:func:`leave`, then :func:`run_wave`: one step of a batch whose leavers
    need not be answered before the wave (a backend's own ``search``).

    Returns:
        (member, result, tree) of each member that left, in row order.
    """
    planned = time.perf_counter()
    left, ks = leave(batch, members, times, wave_target_ms)
    run_wave(batch, members, ks, times, since=planned)
    return left


def search_alone(batch: TreeBatch, members: list[Member]) -> "tuple[list[SearchResult], list]":
    """Runs ``batch`` (its rows joined, ``members[b]`` row b's budget) until
    every member has left: a backend's ``search`` call. Returns the results and
    trees in row order."""
    order = {id(m): i for i, m in enumerate(members)}
    results: list = [None] * len(members)
    trees: list = [None] * len(members)
    members = list(members)
    times = WaveTimes(sliced=batch.slice_ms is not None)
    while members:
        for m, r, t in step(batch, members, times):
            results[order[id(m)]], trees[order[id(m)]] = r, t
    return results, trees


def sliced_waves(one_wave, ks: np.ndarray, k_max: int, live, slice_ms: float) -> bool:
    """A sliced wave by waves of at most K: ``one_wave(sub)`` (int64 [B]) over the
    trees with simulations left of ``ks`` and a root not proven (``live()``),
    at least once, until ``slice_ms`` has passed. False if any of them failed
    (the model could not value it)."""
    end = time.perf_counter() + slice_ms / 1e3
    left, ok = ks.copy(), True
    while True:
        sub = np.where(live(), np.minimum(left, k_max), 0)
        if not sub.any():
            return ok
        ok = one_wave(sub) and ok
        left -= sub
        if time.perf_counter() >= end:
            return ok


def ended_by(member: Member) -> tuple[bool, bool]:
    """(deadline_reached, stopped) for a member that left."""
    return member.end == END_DEADLINE, member.end == END_STOPPED

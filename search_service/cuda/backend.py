"""The CUDA search backend: MCTS over B trees in CuPy kernels.

Semantics are the CPU reference's (:mod:`search_service.mcts.cpu_reference`:
UCT with random rollouts, PUCT with a value model, virtual loss, one node per
simulation, negamax backup, Philox rollouts with the same counters, the same
final action, principal variation and result fields). How the work is laid
out (``kernels/search.cu`` has the details and the concurrency invariants):

* K = ``parallel_sims`` simulations are in flight per tree, run by W warps of
  up to G = ``sims_per_warp`` simulations each (W = ceil(K / G)). A warp runs
  whole waves -- G selections one after another (one warp per selection,
  threads scoring the 7 children, a ``__shfl_xor_sync`` argmax), one node per
  distinct stopping edge (slots from one ``atomicAdd``), G rollouts on G
  threads, backup -- until the budget or the deadline.
* Rollouts: the whole search is ONE kernel launch (plus one launch that sets
  the trees up and one that reads out the results: three launches and one
  copy back per call, whatever the number of simulations).
* Value model: each wave is two launches around a host round trip: the first
  selects, expands and writes the leaves' observations (uint8 [B*K, 2, 6, 7],
  on the device), the evaluator is called once with the wave's distinct
  unfinished leaves, the second writes the priors and backs up. A wave the
  evaluator cannot value (EvaluationFailed) is taken back out by
  ``mcts_vm_undo`` instead (virtual losses released, its nodes unlinked),
  and later waves value their leaves with the reference's Philox rollouts on
  the host, in the same tree -- or the search answers, past its deadline.
  With device waves the search is a generator of waves (``_Search._steps``)
  that the device waves drive (``DeviceWaves.run``): wave by wave on the
  caller's thread, or, in co-located mode, on the reward service's
  critical-lane worker (``InProcessLink.drive``: no thread hop per wave).
* MCTS-Solver: every backup kernel proves what it can up the paths whose
  leaf has a known result (``solve_wave``); a tree whose root is proven runs
  no more simulations; the result carries the root's and its children's
  known results, from which :func:`best_action` plays the proof.

Exactness: with one warp per tree (W = 1: K = 1, or K <= G) a tree is
searched in exactly the reference's order, so root visit counts, values and
the whole tree (slots included) equal the CPU reference's for the same seed
(value-model trees with K > 1 up to float32 rounding of value sums, which
the warp adds in another order). With W > 1 the warps of a tree run
asynchronously and the result depends on timing: same invariants, different
visit counts.

Measured (one H200, 2026-11-30, ``bench/gpu_smoke.py``; wall-clock ms of a
whole ``search`` call, p50 of 30, random rollouts, 1000 simulations of one
tree): K = 1: 9.0 (empty board) / 7.6 (a middle-game position); K = 32:
0.52 / 0.49; K = 64: 0.48 / 0.47; K = 128: 0.47 / 0.45, of which the kernel
is about 0.30 (the rest: set-up, three launches, one copy back). The two
backups are within noise of each other at G = 1; G > 1 serialises selections
on one warp (K = 32 on one warp: 3.6 ms). Batch of 1024 trees, 1000
simulations each: K = 1: 66 M simulations/s (98 M inside the kernel);
K = 4: 111-120 M (245 M); K = 16: 132-140 M (321-344 M). Throughput rises
with the total in flight, 64 -> 16384, with no cliff; past a few thousand
trees the host's per-tree cost (about 5 us: the SearchResult objects) bounds
the wall-clock rate.

Differences from the reference, by design: ``SearchResult.simulations``,
``pool_exhausted`` and ``deadline_reached`` are per tree (the reference's
deadline stops all trees at once; here each tree's warps stop at the
deadline on their own, after at least one wave); the phase times of a rollout
search are the kernel's wall time split by the phases' shares of the warps'
clock cycles; a search with a deadline and no simulation budget allocates
``max_nodes`` slots per tree up front (176 bytes each).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import cupy
import numpy as np

from search_service.cuda import abi
from search_service.backends import cuda_serves
from search_service.cuda import pool as pl
from search_service.cuda.answers import call_model, model_values, result_fields, wave_slots
from search_service.cuda.module import kernel
from search_service.cuda.tree_batch import CudaTreeBatch
from search_service.games import connect4
from search_service.games.connect4 import Positions
from search_service.mcts import tree as tr
from search_service.mcts.backend import (
    DETACH,
    EvaluationFailed,
    LeafEvaluator,
    SearchParams,
    SearchResult,
    WaveClock,
    check_call,
    drive,
    kept_trees,
)
from search_service.mcts.philox import seed_key
from search_service.mcts.batch import search_alone
from search_service.mcts.games import ConnectFourSearch
from search_service.mcts.plan import Member
from search_service.mcts.rollout import rollout_values
from tandem import gpu, nvtx, outputs_gate, ready_word, timeline
from tandem.deadline import Deadline

log = logging.getLogger(__name__)
A = connect4.NUM_ACTIONS


def refuse_other_games(game) -> None:
    """Raises ValueError (why) unless the CUDA backend searches ``game``:
    Connect Four, or a game folder whose rules.cu compiled (:func:`cuda_serves`)."""
    why = CudaBackend.serves(game)
    if why is not None:
        raise ValueError(why)


def _game_batch(backend, params: SearchParams):
    """A :class:`~.game_batch.GameTreeBatch` for ``params.game``, a game folder's game."""
    from search_service.cuda.game_batch import GameTreeBatch
    from search_service.cuda.game_module import device_module

    return GameTreeBatch(backend, params, device_module(params.game.plugin.meta))
BACKUPS = ("warp_aggregated", "global_atomic")
SCALE_TABLE = 1 << 18  # UCT scale(N) = c_uct * sqrt(ln N) from NumPy for N below this (2 MiB)
_BUDGET_NONE = 1 << 30  # "no simulation budget" (deadline only)
_NULL = np.uint64(0)  # a null pointer argument of a kernel
STOP_SLICE = 1024  # simulations per tree per launch when a stop request must be polled
_SCRATCH_KEEP = 8  # buffers kept per kind and shape: searches that run at once
_SCRATCH_KEYS = 32  # kinds and shapes kept at most
COPY_SPIN_S = 0.005  # how long a copy back is waited for by reading its word before the event's wait (s)


class CudaBackend:
    """MCTS in CUDA kernels (see the module docstring).

    Args:
        backup: ``"warp_aggregated"`` (simulations of a warp that share an edge
            combine their updates before the atomics) or ``"global_atomic"``
            (three atomics per edge per simulation).
        sims_per_warp: G, the most simulations one warp runs per wave, 1..32.
            1 (default) spreads a tree's K simulations over K warps: the
            lowest latency. G >= K puts a tree on one warp, whose waves are the
            CPU reference's exactly (for K <= 32), and lets warp_aggregated
            combine up to G simulations' updates.
        value_sims_per_warp: G of value-model searches (None: ``sims_per_warp``).
            There a wave's leaves cost a model call, and warps that select
            at once see each other's virtual losses late, so they pick the
            same leaves more often: in order (32) a wave's leaves are those
            the reference picks, at the cost of a slower selection
            (docs/design.md, "Tree search on the GPU").
        rollout_slice_ms: the time slice of a rollout wave in a batch of
            trees (:meth:`open_batch`; search_service/mcts/plan.py): one
            launch runs each tree's simulations until the slice has passed,
            the kernel reading the clock between a warp's simulations. None:
            waves of K simulations.

    Raises:
        ValueError: an unknown ``backup``, or a G out of range.
    """

    name = "cuda"

    def __init__(self, backup: str = "warp_aggregated", sims_per_warp: int = 1,
                 value_sims_per_warp: int | None = None, rollout_slice_ms: float | None = None):
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {backup!r}")
        for name, g in (("sims_per_warp", sims_per_warp), ("value_sims_per_warp", value_sims_per_warp)):
            if g is not None and (not isinstance(g, (int, np.integer)) or not 1 <= g <= 32):
                raise ValueError(f"{name} must be an int in 1..32, got {g!r}")
        self.backup = backup
        self.sims_per_warp = int(sims_per_warp)
        self.value_sims_per_warp = self.sims_per_warp if value_sims_per_warp is None else int(value_sims_per_warp)
        self.variant = f"gpu_{backup}"
        self.rollout_slice_ms = rollout_slice_ms
        self._lock = threading.Lock()
        self._scale: dict[tuple[int, float], cupy.ndarray] = {}  # (device, c_uct) -> float64 [SCALE_TABLE]
        self._scratch: dict[tuple, list] = {}  # kind and shape -> buffers of finished calls; guarded by _lock

    # -- public API --------------------------------------------------------------
    def search(
        self,
        roots: Positions,
        params: SearchParams,
        evaluator: LeafEvaluator | None = None,
        trees: list | None = None,
        *,
        should_stop: Callable[[], bool] | None = None,
        device_waves=None,
    ) -> tuple[list[SearchResult], list[pl.CudaTree]]:
        """Searches each of the B ``roots`` (unfinished positions) in its own tree.

        Args:
            roots: B positions.
            params: budget and constants.
            evaluator: the leaf evaluator; required for ``value_model``, ignored
                otherwise. It gets uint8 [N, 2, 6, 7] NumPy observations, or a
                CuPy array if it has a true attribute ``accepts_cupy``; it may
                answer with NumPy or CuPy arrays.
            trees: per root, a single tree rooted at it (a :class:`CudaTree`, or
                a NumPy ``Tree``, which is uploaded) to search further, or None
                for a fresh one. Trees passed in are copied, not modified; a
                tree built with another evaluator is replaced.
            should_stop: called between waves (after the first); true ends the
                search there, like a deadline (``extras["stopped"]``). A
                rollout search, otherwise one launch, then runs in slices of
                ``STOP_SLICE`` simulations per tree with a check between slices.
            device_waves: for ``value_model``, a
                :class:`search_service.evaluators.DeviceWaves` (the leaf
                channel's CUDA regions, lent to this call) or None. With one
                whose ``max_rows`` holds a wave, the selection kernel writes the
                leaves into its input region and the backup kernel reads the
                values and priors from its output region: per wave one small
                copy back (the META rows) and one socket round trip, no tensor
                on the host. On an ordered channel (``device_waves.ordered``:
                CUDA events order the two services' work) the wave is sent as
                soon as its selection is queued, with all B * K rows, and the
                META rows come back meanwhile; on one that announces
                (``device_waves.announces``: a ready word) the next wave is
                sent as soon as this one's reply comes, before its selection,
                and its selection is queued right after this wave's backup. The fresh roots go the same way: init_trees writes
                their OBS rows into the input region, and mcts_vm_root_priors
                reads their priors from the output region.

        Returns:
            One result and one :class:`CudaTree` per root.

        Raises:
            ValueError: a finished root, a tree rooted at another position, no
                ``evaluator`` for ``value_model``, an evaluator answer of the
                wrong shape, or a game the backend does not serve
                (:func:`refuse_other_games`). A game folder's game is searched
                by its module (:mod:`.game_batch`: rollouts, fresh trees).
        """
        refuse_other_games(params.game)
        if not isinstance(params.game, ConnectFourSearch):  # a game folder's: its module, rollouts
            started = Deadline.now()  # the deadline counts from the call, tree set-up included
            batch = _game_batch(self, params)
            b = len(params.game.as_states(roots))
            batch.join(roots, trees, [params.seed] * b, list(range(b)))
            deadline = None if params.deadline_ms is None else Deadline.after_ms(params.deadline_ms, started)
            return search_alone(batch, [Member(params.simulations, deadline, should_stop) for _ in range(b)])
        return _Search(self, roots, params, evaluator, trees, should_stop, device_waves).run()

    def open_batch(self, params: SearchParams, evaluator: LeafEvaluator | None = None, lend=None):
        """An empty :class:`~search_service.cuda.tree_batch.CudaTreeBatch` with
        ``params``' constants (their budget and seed are the members'), which
        the search service's wave loop steps (search_service/mcts/batch.py).

        Args:
            params: the constants its trees share.
            evaluator: the leaf evaluator of ``value_model`` trees.
            lend: ``lend()`` -> a context manager of a
                :class:`~search_service.evaluators.DeviceWaves` or None, asked
                once a value-model wave (its leaves stay on the device); None:
                every wave's leaves go by the host.

        Raises:
            ValueError: ``value_model`` without an evaluator (or for a game
                folder's game), or a game the backend does not serve
                (:func:`refuse_other_games`).
        """
        refuse_other_games(params.game)
        if not isinstance(params.game, ConnectFourSearch):
            return _game_batch(self, params)
        return CudaTreeBatch(self, params, evaluator, lend)

    @staticmethod
    def serves(game) -> str | None:
        """None where this backend searches ``game`` (a
        :class:`~search_service.mcts.games.SearchGame`), else why not
        (:func:`search_service.backends.cuda_serves`)."""
        return cuda_serves(game)

    @staticmethod
    def reroot(tree, actions: list[int]) -> pl.CudaTree | None:
        """See :func:`search_service.cuda.pool.reroot` (device-side compaction)."""
        return pl.reroot(tree, actions)

    # -- helpers for _Search ---------------------------------------------------------
    def split(self, k: int, value_model: bool = False) -> tuple[int, int]:
        """(W warps per tree, G simulations per warp) for K in flight."""
        g = min(k, self.value_sims_per_warp if value_model else self.sims_per_warp)
        return -(-k // g), g

    def take_scratch(self, key: tuple, make: Callable[[], tuple]) -> tuple:
        """A search call's buffers for ``key`` (their kind and shape): those a
        finished call gave back, else ``make()``'s. Making them costs the
        host about 0.2 ms of CuPy calls per search, while the GPU waits."""
        with self._lock:
            free = self._scratch.get(key)
            if free:
                buffers = free.pop()
                if not free:
                    del self._scratch[key]
                return buffers
        return make()

    def give_scratch(self, key: tuple, buffers: tuple) -> None:
        """Keeps ``buffers`` for the next call of ``key``: only once no work
        queued by the giving call can still touch them (its stream synchronised).
        At most _SCRATCH_KEEP per key and _SCRATCH_KEYS keys are kept: past
        that, the key given back least recently goes (CuPy's pool has its
        buffers back)."""
        with self._lock:
            free = self._scratch.pop(key, [])  # put back last: the most recent
            if len(free) < _SCRATCH_KEEP:
                free.append(buffers)
            self._scratch[key] = free
            while len(self._scratch) > _SCRATCH_KEYS:
                del self._scratch[next(iter(self._scratch))]

    def scale_table(self, c_uct: float) -> cupy.ndarray:
        """float64 [SCALE_TABLE] on the device: ``c_uct * sqrt(log(max(N, 1)))``
        computed by NumPy exactly as the CPU reference does (so the GPU's
        scores round identically)."""
        key = (cupy.cuda.Device().id, float(c_uct))
        with self._lock:
            tab = self._scale.get(key)
            if tab is None:
                n = np.arange(SCALE_TABLE, dtype=np.float64)
                tab = self._scale[key] = cupy.asarray(c_uct * np.sqrt(np.log(np.maximum(n, 1.0))))
        return tab


class _Search:
    """One search call: trees on the device, the kernels, the results.

    B = ``n_trees``, K = ``parallel_sims``, W = ``warps_per_tree``, G =
    ``sims_per_warp`` (see the module docstring). The device buffers (made by
    ``_allocate``) are ``pool`` (uint8 [B, capacity * NODE_BYTES], the trees'
    node pools), ``tree_state`` (int32 [B * 8], the TS rows), ``cycles``
    (uint64 [B * 4], the CYC rows), ``clock_start`` (uint64 [1], the deadline
    clock's start, ns) and ``result_rows`` (uint8 [B * 296], the RES rows);
    the rows are :mod:`.abi`'s.
    """

    def __init__(self, backend: CudaBackend, roots: Positions, params: SearchParams, evaluator, trees, should_stop=None,
                 device_waves=None):
        self.started_at = time.perf_counter()  # s, perf_counter: the deadline counts from here
        timeline.mark("search.start")
        self.should_stop = should_stop
        self.stopped = False
        self.host_deadline = False  # a sliced rollout search stopped at the deadline between launches
        self.backend = backend
        self.params = params
        self.evaluator = evaluator
        self.puct = params.evaluator == "value_model"  # PUCT selection with priors
        self.use_model = self.puct  # leaves valued by the model; False after an EvaluationFailed
        self.failure = ""  # why the model stopped valuing leaves ("" while it does)
        trees = check_call(roots, params, evaluator, trees)
        b = len(roots)
        self.n_trees = b
        self.roots = roots
        # tree index -> the tree passed in to search further
        self.kept: dict[int, pl.CudaTree] = kept_trees(roots, trees, params.evaluator, pl.as_cuda_tree)
        # int64 [B]: slots in use before the search (a fresh tree: its root)
        self.nodes_in_use = np.array([self.kept[i].num_nodes if i in self.kept else 1 for i in range(b)], np.int64)
        used = int(self.nodes_in_use.max())
        if params.simulations is not None:
            cap = max(used, min(params.max_nodes, used + params.simulations))
        else:
            cap = max(used, params.max_nodes)
        if cap > pl.MAX_CAPACITY:
            raise ValueError(f"a tree of {cap} node slots exceeds the device limit of {pl.MAX_CAPACITY}")
        self.capacity = cap  # node slots per tree's pool
        self.node_limit = min(params.max_nodes, cap)  # slots a search may fill (kept trees may hold more)
        self.parallel_sims = params.parallel_sims
        self.warps_per_tree, self.sims_per_warp = backend.split(self.parallel_sims, self.puct)
        self.phase_ms = dict.fromkeys(abi.PHASES, 0.0)  # wall-clock ms per phase, over the call
        self.waves = 0
        self.gated_waves = 0  # waves whose backup waited for the outputs on the GPU (tandem/outputs_gate.py)
        self.model_simulations = np.zeros(b, np.int64)  # per tree: simulations whose leaf the model valued
        # The device hand-off, where it carries a whole wave (B * K slots, one row each).
        fits = device_waves is not None and device_waves.carries(b * params.parallel_sims)
        self.device_waves = device_waves if self.puct and fits else None
        self._waves: tuple | None = None  # (scratch key, buffers) of the wave loop, once it has them
        timeline.mark("search.checked")

    # -- set-up --------------------------------------------------------------------
    def _allocate(self) -> None:
        b, cap = self.n_trees, self.capacity
        self.pool = cupy.empty((b, cap * pl.NODE_BYTES), np.uint8)
        self._state_key = ("state", cupy.cuda.Device().id, b)
        self._state = self.backend.take_scratch(self._state_key, lambda: _state_buffers(b))
        (self.tree_state, self.cycles, self.clock_start, self.result_rows, self.init_dev, self._init_host,
         self._results_back) = self._state
        for i, t in self.kept.items():
            pl.copy_into(self.pool.data.ptr + i * cap * pl.NODE_BYTES, cap, t)

    def _init_rows(self, fresh: np.ndarray) -> np.ndarray:
        """The B trees' INIT rows (abi.INIT.dtype [B]), what init_trees reads;
        ``fresh``: bool [B], the trees not passed in."""
        b = self.n_trees
        init = np.zeros(b, abi.INIT.dtype)
        init["current"] = self.roots.current
        init["mask"] = self.roots.mask
        init["nodes"] = self.nodes_in_use
        init["fresh"] = fresh
        if self.puct and fresh.any():
            idx = np.flatnonzero(fresh)
            init["root_visits"][idx] = 1  # the root's own evaluation: sqrt(N) > 0 at the first choice
            if self.device_waves is not None:
                return init  # valued on the device once init_trees wrote them (_device_root_priors)
            t = time.perf_counter()
            try:
                _, priors = call_model(self.evaluator, self.roots.current[idx], self.roots.mask[idx])
            except EvaluationFailed as exc:
                self._stop_using_model(exc)  # uniform priors stay; rollouts value the leaves
                priors = None
            if priors is not None:
                init["has_priors"][idx] = 1
                init["priors"][idx] = priors
            self.phase_ms["evaluate"] += (time.perf_counter() - t) * 1e3
        return init

    def _device_root_priors(self, rows: int, init):
        """Generator (a device wave): values the fresh roots through the device waves: init_trees wrote
        fresh tree b's OBS row at row b of the input region; one call values
        rows ``[0, rows)`` (``rows``: the last fresh tree's + 1; announced by
        :meth:`_steps` once the trees are allocated, where the channel announces), and ``mcts_vm_root_priors`` sets their
        priors from the output region's logits. So the root, like every leaf,
        never crosses the host. Without a policy head the uniform priors
        stay; a failed call stops the model (rollouts value the leaves), as
        on the host way."""
        t = time.perf_counter()
        if not self.device_waves.ordered:  # else the channel's event orders init_trees before the model's copy
            cupy.cuda.get_current_stream().synchronize()  # init_trees's rows in place before the call
        try:
            with nvtx.span("search.evaluate"):
                _, logits = yield rows
                if self.device_waves.announces:  # the first wave's message goes while the roots' model runs
                    self.device_waves.announce(self.n_trees * self.parallel_sims)
                self.device_waves.wait_outputs()
        except EvaluationFailed as exc:  # an announced first wave: given up by the channel's failed wait
            self._stop_using_model(exc)
            logits = None
            yield DETACH
        if logits is not None:
            timeline.gpu_mark("gpu.backup")
            kernel("mcts_vm_root_priors")(
                ((self.n_trees + 127) // 128,), (128,),
                (self.pool, np.int64(self.capacity), np.int32(self.n_trees), init, self.device_waves.inputs, logits),
            )
        self.phase_ms["evaluate"] += (time.perf_counter() - t) * 1e3

    # -- the search -------------------------------------------------------------------
    def run(self) -> tuple[list[SearchResult], list[pl.CudaTree]]:
        """The whole search: :meth:`_steps` driven by the device waves (which
        may run it on the reward service's critical-lane worker: co-located
        mode), or on this thread."""
        steps = self._steps()
        try:
            return drive(steps, None) if self.device_waves is None else self.device_waves.run(steps)
        except Exception:
            # Its buffers are dropped, not given back: first let the work it queued finish (a
            # driven search's stream is joined to this one before its error reaches here), so
            # neither CuPy's pools nor the pinned INIT staging hand memory on that is still in use.
            try:
                cupy.cuda.get_current_stream().synchronize()
            except Exception:  # noqa: BLE001 - a broken context: the exception under way says more
                log.exception("a failed search's stream could not be synchronised")
            raise

    def _steps(self):
        """The search as a generator: it yields the rows of each device wave
        (rows ``[0, rows)`` of the device waves' input region, written by
        kernels queued on the current stream), gets back (values, logits) --
        views of the output region -- or has the EvaluationFailed thrown in,
        and yields DETACH once it needs no more device waves (the model
        stopped valuing leaves, or the waves are over: only the answer is
        left); it returns (results, trees). Without device waves it yields
        only DETACH, where the model stops."""
        self._allocate()
        timeline.mark("search.allocated")
        fresh = np.array([i not in self.kept for i in range(self.n_trees)])
        root_rows = int(np.flatnonzero(fresh)[-1]) + 1 if self.device_waves is not None and fresh.any() else 0
        if root_rows and self.device_waves.announces:
            # The roots' wave is announced now: the reward service's socket, lease and hand-over run
            # while the trees are initialised, not after init_trees (docs/design.md, "Announced waves").
            # Not before the allocation: a first pool of its size may take longer than the client's
            # window for the inputs (5 ms), and a roots' wave given up turns the model off.
            try:
                self.device_waves.announce(root_rows)
            except EvaluationFailed:  # the channel closed itself: the roots' evaluate says so, and is undone
                pass
        init_rows = self._init_rows(fresh)
        timeline.mark("search.init_rows")
        init = self.init_dev
        self._init_host[:] = init_rows.view(np.uint8)  # pinned: the copy below is queued, not staged by the driver
        cupy.cuda.runtime.memcpyAsync(init.data.ptr, self._init_host.ctypes.data, init_rows.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, cupy.cuda.get_current_stream().ptr)
        timeline.mark("search.init_copied")
        # With device waves (value-model searches only) the fresh roots' OBS rows go into the input region.
        on_device = root_rows > 0
        kernel("init_trees")(
            ((self.n_trees + 127) // 128,),
            (128,),
            (
                self.pool, np.int64(self.capacity), np.int32(self.n_trees), init, self.tree_state, self.cycles,
                self.clock_start, self.device_waves.inputs if on_device else np.uint64(0),
            ),
        )
        timeline.mark("search.initialised")
        if on_device:
            timeline.gpu_mark("gpu.selected")  # the roots' OBS rows are written
            yield from self._device_root_priors(root_rows, init)
        if self.puct:
            deadline_reached = yield from self._value_model_waves()
            if self.device_waves is not None:
                yield DETACH  # the waves are over: the answer is made on the caller's thread, off the lane
        else:
            deadline_reached = None
            self._rollout_search()
        t = time.perf_counter()
        timeline.mark("search.finish")
        kernel("finish_trees")(
            ((self.n_trees + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,),
            (32 * abi.WARPS_PER_BLOCK,),
            (
                self.pool, np.int64(self.capacity), np.int32(self.n_trees), self.tree_state, self.cycles,
                self.result_rows,
            ),
        )
        self._results_back.start()
        # [B]: copied out of the pinned buffer, which goes back with the scratch (the stream is done with it)
        res = self._results_back.finish().copy().view(abi.RESULT.dtype)
        self.backend.give_scratch(self._state_key, self._state)
        if self._waves is not None:
            self.backend.give_scratch(*self._waves)
        timeline.mark("search.results")
        kernel_ms = (time.perf_counter() - self.launched_at) * 1e3 if not self.puct else None
        if not self.puct:
            self._split_kernel_time(kernel_ms, res)
        else:
            self.phase_ms["backup"] += (time.perf_counter() - t) * 1e3
        nodes = self._num_nodes(res["nodes"]).tolist()  # [B]: slots in use, for the results and the trees
        results = self._results(res, nodes, deadline_reached, kernel_ms)
        timeline.mark("search.answered")
        out = results, self._trees(nodes)
        timeline.mark("search.end")
        return out

    def _rollout_search(self) -> None:
        params, g = self.params, self.sims_per_warp
        key = seed_key(params.seed)
        deadline_ns = 0
        if params.deadline_ms is not None:
            left_ms = params.deadline_ms - (time.perf_counter() - self.started_at) * 1e3
            deadline_ns = max(int(left_ms * 1e6), 1)
        total = params.simulations if params.simulations is not None else _BUDGET_NONE
        name = "mcts_rollout_aggregated" if self.backend.backup == "warp_aggregated" else "mcts_rollout_global"
        warps = self.n_trees * self.warps_per_tree
        # Dynamic shared memory, bytes: the column table, then per warp search.cu's warp_scratch_ints(G) int32s.
        smem = abi.COLUMN_TABLE_BYTES + abi.WARPS_PER_BLOCK * (g * abi.MAX_DEPTH + 64) * 4
        scale = self.backend.scale_table(params.c_uct)
        fn = kernel(name)

        def launch(budget: int) -> None:
            fn(
                ((warps + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,),
                (32 * abi.WARPS_PER_BLOCK,),
                (
                    self.pool, np.int64(self.capacity), np.int32(self.node_limit), np.int32(self.n_trees),
                    np.int32(self.warps_per_tree), np.int32(g), np.int32(self.parallel_sims), np.int32(budget),
                    np.int64(deadline_ns), self.clock_start, self.tree_state, self.cycles, np.float64(params.c_uct),
                    np.float64(params.virtual_loss), scale, np.int32(SCALE_TABLE),
                    np.uint32(key[0]), np.uint32(key[1]), _NULL, _NULL,  # one budget and key for every tree
                ),
                shared_mem=smem,
            )

        self.launched_at = time.perf_counter()
        if self.should_stop is None:
            with nvtx.span("search.rollout_kernel"):  # select, expand, evaluate and backup in one kernel
                launch(total)
            return
        # Slices: each launch continues the last (the per-tree claim counter
        # persists and never passes the budget); a multiple of K keeps the
        # waves of a one-warp tree the same as in one launch.
        step = self.parallel_sims * -(-STOP_SLICE // self.parallel_sims)
        budget = 0
        stream = cupy.cuda.get_current_stream()
        while budget < total:
            budget = min(total, budget + step)
            with nvtx.span("search.rollout_kernel"):
                launch(budget)
                stream.synchronize()
            if params.deadline_ms is not None and (time.perf_counter() - self.started_at) * 1e3 >= params.deadline_ms:
                self.host_deadline = budget < total
                return
            if budget < total and self.should_stop():
                self.stopped = True
                return

    def _split_kernel_time(self, kernel_ms: float, res: np.ndarray) -> None:
        """Splits the kernel's wall time over the phases by their shares of the warps' cycles."""
        cycles = res["cycles"].astype(np.float64).sum(axis=0)  # [len(PHASES)]
        total = cycles.sum()
        share = cycles / total if total > 0 else np.eye(len(abi.PHASES))[0]  # all to select
        for name, s in zip(abi.PHASES, share):
            self.phase_ms[name] += kernel_ms * float(s)

    def _value_model_waves(self):
        """Generator: the wave loop for PUCT with the value model (yields each
        device wave's rows, as :meth:`_steps`); returns deadline_reached."""
        params, b, k_max = self.params, self.n_trees, self.parallel_sims
        w, g = self.warps_per_tree, self.sims_per_warp
        n = b * k_max
        dw = self.device_waves
        # What one wave's selection hands the host, copied back in one piece:
        # the META rows, then the OBS rows, of the n simulation slots. With
        # device waves the OBS rows are the leaf channel's input region and
        # only the META rows come back; on an ordered channel (DeviceWaves.ordered)
        # they come back into pinned memory while the wave is valued, and are
        # read after the backup is queued (before the outputs are waited for,
        # on one that announces: they plan the next wave).
        ordered_back = dw is not None and dw.ordered
        key = ("waves", cupy.cuda.Device().id, n, dw is None, ordered_back)
        buffers = self.backend.take_scratch(key, lambda: _wave_buffers(n, dw is None, ordered_back))
        self._waves = (key, buffers)  # given back once the search's stream is synchronised
        stage, meta_dev, obs_dev, meta_back, paths, vin_dev, verdict = buffers
        if dw is not None:
            obs_dev = dw.inputs.reshape(-1, abi.OBS.words)[:n]
        stage_sizes = (meta_dev.nbytes, stage.nbytes - meta_dev.nbytes)  # the host copy of stage, carved alike
        aggregated = self.backend.backup == "warp_aggregated"
        backup_kernel = kernel("mcts_vm_backup_aggregated" if aggregated else "mcts_vm_backup_global")
        grid = ((b * w + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,)
        block = (32 * abi.WARPS_PER_BLOCK,)
        slot = np.arange(n)
        in_wave_of = slot % k_max
        wants_cupy = bool(getattr(self.evaluator, "accepts_cupy", False))
        done = np.zeros(b, np.int64)  # simulations completed per tree (the rollouts' Philox counters)
        live = np.ones(b, bool)  # trees whose root is not proven (as of the last selection)
        tree_of = slot // k_max
        clock = WaveClock(params.deadline_ms, self.started_at)

        def ordered_live() -> np.ndarray:  # an ordered wave's live trees, from its META rows come back
            return wave_slots(meta_back.finish().view(abi.META.dtype), in_wave_of < k, b)[1]

        def plan(live: np.ndarray, done: np.ndarray, waves: int = 1) -> tuple[int | None, bool]:
            """The next wave's simulations per tree, or None and what the loop
            returns (deadline_reached). ``waves`` 2: asked during the wave
            before it, counted as run (to announce it)."""
            if not live.any():
                return None, False
            k = k_max if params.simulations is None else min(k_max, params.simulations - int(done[live][0]))
            if k <= 0:
                return None, False
            # At least one wave runs, unless an undone one already took the time; none
            # starts that is expected to end past the deadline.
            ran = self.waves or self.failure or waves > 1
            if ran and clock.out_of_time(waves):
                return None, True
            if self.should_stop is not None and ran and self.should_stop():
                self.stopped = True
                return None, False
            return k, False

        select_tail = (np.float64(params.c_puct), np.float64(params.virtual_loss), self.tree_state, meta_dev, paths,
                       obs_dev, _NULL)  # _NULL: k simulations in every tree

        def select(k: int) -> tuple:
            """Queues wave ``k``'s selection (and, ordered, its ready mark and
            META copy; else waits for them): (start and end, perf_counter s; its
            kernel args, on_device, ordered, staged)."""
            timeline.mark("wave.select")
            t = time.perf_counter()
            clock.begin_wave()
            args = (self.pool, np.int64(self.capacity), np.int32(self.node_limit), np.int32(b), np.int32(w),
                    np.int32(g), np.int32(k_max), np.int32(k))
            on_device = dw is not None and self.use_model  # the backup kernel reads the model's outputs
            ordered = on_device and meta_back is not None  # sent unsynchronised: the channel's events order it
            staged = None
            with nvtx.span("search.select"):
                kernel("mcts_vm_select")(grid, block, (*args, *select_tail))
                if on_device:
                    timeline.gpu_mark("gpu.selected")
                if ordered:
                    dw.inputs_written()  # first: the reward service may be waiting for it already
                    meta_back.start()
                else:
                    staged = stage.get()  # waits for the selection: the leaves are in place
            timeline.mark("wave.staged")
            return t, time.perf_counter(), args, on_device, ordered, staged

        # The next wave's k once its message went ahead (announced): it runs, its selection
        # queued right after this wave's backup (queued: the selection's select() answer).
        committed = queued = None
        timeline.mark("search.waves_ready")
        try:
            while True:
                if queued is not None:
                    k, (t, t1, args, on_device, ordered, staged), queued = queued[0], queued[1], None
                else:
                    k, deadline_reached = plan(live, done)
                    if k is None:
                        return deadline_reached
                    t, t1, args, on_device, ordered, staged = select(k)
                open_ = None  # unknown until the META rows are read: an ordered wave values all n rows
                if not ordered:
                    meta_host, obs_host = abi.carve(staged, *stage_sizes)
                    meta = meta_host.view(abi.META.dtype)  # [n]
                    ran, live, open_ = wave_slots(meta, in_wave_of < k, b)
                    if not live.any():
                        return False  # every root is proven
                has_priors = False  # the host's EVAL rows hold priors (device waves: wherever logits come back)
                outputs = (None, None)  # device waves: the model's (values, logits) for the backup to read
                gate = None  # their gate, where the backup waits for them on the GPU (tandem/outputs_gate.py)
                used_model = self.use_model
                if not on_device:  # the host builds them: exact values where known, the leaves' planes
                    vin = np.zeros(n, abi.EVAL.dtype)
                    vin["value"] = tr.OUTCOME_VALUE[np.where(ran, meta["terminal"], tr.NOT_TERMINAL)]  # ran: written
                    planes = (obs_host if dw is None else obs_dev.get()).reshape(n, 2, connect4.ROWS, connect4.COLUMNS)
                try:
                    if on_device:
                        outputs = yield from self._device_values(open_, n)
                        if ordered and dw.announces:  # while the model runs: its META rows, the next message
                            live = ordered_live()
                            committed = plan(live, done + np.where(live, k, 0), 2)[0]
                            if committed is not None:
                                dw.announce(n)
                        gate = dw.outputs_gate() if ordered else None
                        if gate is None:
                            dw.wait_outputs()  # before the backup reads them
                    elif self.use_model:
                        has_priors, _ = model_values(self.evaluator, vin, planes, obs_dev, open_, meta["leader"],
                                                     wants_cupy)
                    elif open_.any():
                        pos = connect4.from_observation(planes[open_])
                        sims = done[tree_of[open_]] + in_wave_of[open_]
                        vin["value"][open_] = rollout_values(pos.current, pos.mask, sims, tree_of[open_], params.seed)
                except EvaluationFailed as exc:  # an announced next wave: given up by the channel's failed wait
                    committed = None
                    with nvtx.span("search.undo"):
                        kernel("mcts_vm_undo")(grid, block, (*args, self.tree_state, meta_dev, paths, _NULL))
                    self._stop_using_model(exc)
                    self.phase_ms["select"] += (t1 - t) * 1e3
                    self.phase_ms["evaluate"] += (time.perf_counter() - t1) * 1e3
                    if ordered:
                        live = ordered_live()
                    clock.end_wave()
                    yield DETACH  # no more device waves: the rest may run on the caller's thread
                    continue
                t2 = time.perf_counter()
                with nvtx.span("search.backup"):
                    if not on_device:
                        vin_dev.set(vin.view(np.float32))
                    null = np.uint64(0)
                    values, logits = (null if x is None else x for x in outputs)
                    if gate is not None:  # the backup waits for the outputs on the GPU, not here
                        outputs_gate.queue(gate, verdict.data.ptr)
                        self.gated_waves += 1
                    if on_device:
                        timeline.gpu_mark("gpu.backup")
                    backup_kernel(
                        grid, block,
                        (
                            self.pool, np.int64(self.capacity), np.int32(self.node_limit), np.int32(b), np.int32(w),
                            np.int32(g), np.int32(k_max), np.int32(k), self.tree_state, meta_dev, paths, vin_dev,
                            np.int32(has_priors), np.int32(on_device), values, logits,
                            obs_dev if on_device else null, null if gate is None else verdict, _NULL,
                        ),
                    )
                t3 = time.perf_counter()
                timeline.mark("wave.backed_up")
                clock.end_wave()
                if committed is not None and clock.out_of_time():  # the wait for the outputs took its time
                    dw.cancel_announced()
                    committed = None
                selected_next = committed is not None
                if selected_next:  # announced: its selection goes at once, the bookkeeping after
                    queued, committed = (committed, select(committed)), None
                waited = 0.0  # s: a gated wave's wait for its outputs, after its backup was queued
                if gate is not None:
                    t4 = time.perf_counter()
                    try:  # the outputs, behind the backup (and the next selection) already queued
                        dw.wait_outputs()
                    except EvaluationFailed as exc:  # the gate's verdict: closed, and the backup undid the wave
                        self._gate_closed(exc, queued, grid, block, meta_dev, paths)
                        if queued is not None:
                            clock.end_wave()  # the next wave, undone too: its time counted as a wave's
                        queued = None
                        self.phase_ms["select"] += (t1 - t) * 1e3
                        self.phase_ms["evaluate"] += (time.perf_counter() - t1) * 1e3
                        live = ordered_live()
                        yield DETACH
                        continue
                    waited = time.perf_counter() - t4  # the evaluation's, as an ungated wave's wait is
                if not selected_next and ordered:
                    if not dw.announces:  # the selection ended long before the reply: this waits for nothing
                        live = ordered_live()
                    if not live.any():
                        return False  # every root was proven before this wave
                self.phase_ms["select"] += (t1 - t) * 1e3
                self.phase_ms["evaluate"] += (t2 - t1 + waited) * 1e3
                self.phase_ms["backup"] += (t3 - t2) * 1e3
                done += np.where(live, k, 0)
                if used_model:
                    self.model_simulations += np.where(live, k, 0)
                self.waves += 1
        finally:
            if dw is not None:  # a search ended by an exception leaves no gate open (else nothing pending)
                dw.abandon_outputs()
            # no pinned buffer goes back to CuPy's pool with its copy still running
            if meta_back is not None:
                try:
                    meta_back.finish()  # a copy started and not finished: a search ended by an exception
                except Exception:  # noqa: BLE001 - a broken context: the exception under way says more
                    log.exception("the META rows' copy back could not be waited for")

    def _device_values(self, open_: np.ndarray | None, n: int):
        """Generator: values the wave's leaves as one device wave (their OBS
        rows are the device waves' input region: it yields the rows) and
        returns the output region's (values, logits) -- (None, None) where no
        leaf is open -- for the backup kernel to read on the device
        (``vm_backup``'s from_outputs: the host way's rules, in float32).
        ``open_``: bool [n], the slots with an unfinished leaf, or None where
        the host does not know them yet (an ordered wave: all n rows are
        valued).

        Raises:
            EvaluationFailed: thrown in at the yield: the hand-off failed, or
                outputs of the wrong shape.
        """
        if open_ is not None and not open_.any():
            return None, None
        # every leaf's evaluating row is at or before the last open one; unknown: all of them
        rows = n if open_ is None else int(np.flatnonzero(open_)[-1]) + 1
        with nvtx.span("search.evaluate"):
            values, logits = yield rows
        return values, logits

    def _gate_closed(self, exc: EvaluationFailed, queued, grid, block, meta_dev, paths) -> None:
        """A gated wave's outputs never came: its backup undid it on the GPU;
        the next wave (``queued``: announced, its selection queued behind that
        backup; or None) is undone and given up too, and the model is not
        used again in this search."""
        if queued is not None:
            kernel("mcts_vm_undo")(grid, block, (*queued[1][2], self.tree_state, meta_dev, paths, _NULL))
            self.device_waves.cancel_announced()
        self._stop_using_model(exc)

    def _stop_using_model(self, exc: EvaluationFailed) -> None:
        self.use_model = False
        self.failure = str(exc) or type(exc).__name__

    # -- answer ---------------------------------------------------------------------------
    def _root_priors(self, root_visits: np.ndarray) -> np.ndarray | None:
        """float32 [B, A]: the roots' priors, read from the pools (one small
        copy) only where a tree has no root visit at all (``root_visits``:
        int64 [B], the roots' completed simulations; best_action's policy
        move); else None."""
        if root_visits.all():
            return None
        start = pl.offsets(self.capacity)[0]  # the root's row of records: its edges
        rows = self.pool[:, start : start + abi.NODE_ROW.itemsize].get()
        return np.ascontiguousarray(rows).view(abi.NODE_ROW)["edges"]["prior"].reshape(self.n_trees, A)

    def _num_nodes(self, claimed: np.ndarray) -> np.ndarray:
        """int64 [B]: slots in use, from ``claimed`` (int [B], RES ``nodes``:
        claims past the limit were refused)."""
        return np.minimum(claimed, np.maximum(self.node_limit, self.nodes_in_use))

    def _results(self, res: np.ndarray, nodes: list[int], deadline_reached: bool | None,
                 kernel_ms: float | None) -> list[SearchResult]:
        used, ms = self.model_simulations.tolist(), self.phase_ms
        common = {
            "warps_per_tree": self.warps_per_tree,
            "sims_per_warp": self.sims_per_warp,
            "backup": self.backend.backup,
            "kernel_ms": kernel_ms,
            "pool_bytes": self.capacity * pl.NODE_BYTES,
            "stopped": self.stopped,
            "gated_waves": self.gated_waves,
        }
        results = []
        for i, (fields, deadline) in enumerate(result_fields(res, self.roots.current, self.roots.mask,
                                                             self._root_priors)):
            done = fields["simulations"]
            results.append(SearchResult(
                **fields,
                tree_nodes=nodes[i],
                deadline_reached=(deadline or self.host_deadline) if deadline_reached is None else deadline_reached,
                select_ms=ms["select"],
                expand_ms=ms["expand"],
                evaluate_ms=ms["evaluate"],
                backup_ms=ms["backup"],
                tree_reused=i in self.kept,
                model_simulations=used[i],
                evaluation_failure=self.failure,
                extras={"waves": self.waves if self.puct else -(-done // self.parallel_sims), **common},
            ))
        return results

    def _trees(self, nodes: list[int]) -> list[pl.CudaTree]:
        cur, mask, ev, cap = self.roots.current.tolist(), self.roots.mask.tolist(), self.params.evaluator, self.capacity
        return [pl.CudaTree(self.pool, i, cap, nodes[i], cur[i], mask[i], ev) for i in range(self.n_trees)]


def _state_buffers(b: int) -> tuple:
    """A call's small per-tree device state, one allocation carved (abi's
    rows): TS int32 [B * 8], CYC uint64 [B * 4], the deadline clock's start
    uint64 [1], RES uint8 [B * 296], INIT uint32 [B * 16]; the INIT
    rows' pinned host staging, uint8 [B * 64]; and the RES rows' copy back
    (an _AsyncCopy)."""
    import cupyx  # noqa: PLC0415 - with CuPy

    sizes = (b * abi.TREE_STATE.nbytes, b * abi.CYCLES.nbytes, 8, b * abi.RESULT.nbytes, b * abi.INIT.nbytes)
    ts, cyc, t0, res, init = abi.carve(cupy.empty(sum(sizes), np.uint8), *sizes)
    return (ts.view(np.int32), cyc.view(np.uint64), t0.view(np.uint64), res, init.view(np.uint32),
            cupyx.empty_pinned(b * abi.INIT.nbytes, np.uint8), _AsyncCopy(res))


def _wave_buffers(n: int, with_obs: bool, ordered: bool) -> tuple:
    """The value-model wave loop's buffers for ``n`` simulation slots:
    ``stage`` (uint8, the META rows then, ``with_obs``, the OBS rows: what a
    wave's selection hands the host, copied back in one piece), its META
    view int32 [n * 4] and OBS view uint8 [n, 84] (None without), the META
    rows' copy back into pinned memory (``ordered``; else None), ``paths``
    int32 [n * MAX_DEPTH], the EVAL rows float32 [n * 8] and the outputs'
    gate's verdict int32 [1] (tandem/outputs_gate.py; ``ordered``, else None)."""
    sizes = (n * abi.META.nbytes, n * abi.OBS.nbytes if with_obs else 0)
    stage = cupy.empty(sum(sizes), np.uint8)
    meta_dev, obs_dev = abi.carve(stage, *sizes)
    return (stage, meta_dev, obs_dev.reshape(n, abi.OBS.words) if with_obs else None,
            _AsyncCopy(meta_dev) if ordered else None,
            cupy.empty(n * abi.MAX_DEPTH, np.int32), cupy.empty(n * abi.EVAL.words, np.float32),
            cupy.zeros(1, np.int32) if ordered else None)


class _AsyncCopy:
    """A device buffer's copy into pinned host memory, queued on the current
    stream (:meth:`start`) and waited for on the host later (:meth:`finish`).

    The wait reads a word of the pinned buffer that the stream sets to the
    copy's number after the copy (tandem/ready_word.py's mapped store): plain
    memory reads keep the thread on its core, where a wait in the driver
    let it go cold -- the host work after it took up to 4x its warm time
    on the H200's host (docs/design.md, "The leaf channel": waits that
    keep the host warm). Past ``COPY_SPIN_S`` the copy's event is waited for instead."""

    def __init__(self, dev: cupy.ndarray):
        import cupyx  # noqa: PLC0415 - with CuPy

        self._dev = dev
        self._nbytes = dev.nbytes
        at = -(-self._nbytes // 8) * 8  # the word, 8-byte aligned after the copy
        self._buffer = cupyx.empty_pinned(at + 8, np.uint8)
        self._host = self._buffer[: self._nbytes]
        self._word = self._buffer[at:].view(np.uint64)
        self._word[0] = 0
        self._word_dev = cupy.cuda.runtime.pointerGetAttributes(self._word.ctypes.data).devicePointer
        self._store = ready_word.mapped_store(cupy, self._word_dev)
        self._seq = 0
        self._event = cupy.cuda.Event(block=False, disable_timing=True)

    def start(self) -> None:
        stream = cupy.cuda.get_current_stream()
        # The runtime's copy, not ndarray.get(out=, blocking=False): that measured slower, 0.90 of a
        # synchronised search against 0.77 (one run each, H200, 2026-12-01).
        cupy.cuda.runtime.memcpyAsync(self._host.ctypes.data, self._dev.data.ptr, self._nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._seq += 1
        try:
            self._store(stream.ptr, self._word_dev, self._seq)
        finally:  # the event covers the copy whatever the store did: finish's backstop
            self._event.record(stream)

    def finish(self) -> np.ndarray:
        """uint8 [nbytes]: the copy, once done (a view, valid until the next start).

        Raises:
            cupy.cuda.runtime.CUDARuntimeError: the copy failed.
        """
        word, seq = self._word, self._seq
        if COPY_SPIN_S > 0 and gpu.spins():
            spin_until = time.monotonic() + COPY_SPIN_S
            while int(word[0]) != seq and time.monotonic() < spin_until:
                os.sched_yield()  # the GIL goes too
        self._event.synchronize()  # done already where the word came; else the backstop
        return self._host

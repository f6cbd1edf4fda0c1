"""The CUDA search backend: MCTS over device trees in CuPy kernels.

Semantics are the CPU reference's (:mod:`search_service.mcts.cpu_reference`:
UCT with random rollouts, PUCT with a value model, virtual loss, one node per
simulation, negamax backup, Philox rollouts with the same counters, the same
final action, principal variation and result fields). The trees live in a
batch of trees that searches join and leave between waves: Connect Four's
:class:`~.tree_batch.CudaTreeBatch` (its docstring has the host's side) and
a game folder's :class:`~.game_batch.GameTreeBatch` (rollouts). The search
service's wave loop steps one (:meth:`CudaBackend.open_batch`); a
:meth:`CudaBackend.search` call is a private batch of its B roots, joined at
once and stepped until every search has left
(:func:`~search_service.mcts.batch.search_alone`): the kernels and host code
the service runs, as the CPU reference's ``search`` is. How the work is laid
out (``kernels/search.cu`` has the details and the concurrency invariants):

* K = ``parallel_sims`` simulations are in flight per tree, run by W warps of
  up to G = ``sims_per_warp`` simulations each (W = ceil(K / G)). A warp runs
  whole waves -- G selections one after another (one warp per selection,
  threads scoring the 7 children, a ``__shfl_xor_sync`` argmax), one node per
  distinct stopping edge (slots from one ``atomicAdd``), G rollouts on G
  threads, backup -- until its tree's budget or the time slice.
* Rollouts: a ``search`` call's batch (Connect Four's or a game folder's) is sliced
  (search_service/mcts/plan.py) by the whole search, so the search is ONE
  launch of the rollout kernel: each tree runs to its simulation cap, or
  until the time left to the call's deadline has passed (the kernel reads
  the clock between a warp's waves; every tree runs one at least). Around
  it: ``init_trees`` and ``finish_trees`` at the join, ``finish_trees``
  after the launch (each with its RES rows copied back), and (Connect
  Four's) a compact copy of each tree at the end. With ``should_stop`` the slices last at most the
  backend's ``rollout_slice_ms`` (``STOP_SLICE_MS`` where it has none), the
  check between them; a search with a deadline then ends before a slice
  expected to end past it, as the service's sliced waves do.
* Value model: waves of K, each two launches around a host round trip
  (selection writing the leaves' observations, uint8 [B*K, 2, 6, 7] on the
  device; one evaluator call with the wave's distinct unfinished leaves;
  backup). A fresh root's priors come from the first wave's call, alone. A
  wave the evaluator cannot value (EvaluationFailed) is taken back out by
  ``mcts_vm_undo`` (virtual losses released, its nodes unlinked), and the
  tree goes on with the reference's Philox rollouts on the host. With device
  waves (``search(device_waves=)``) the selection writes the leaves into
  their input region and the backup reads the model's outputs from their
  output region: no leaf on the host.
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

Timings: ``bench/gpu_smoke.py``, ``bench/mcts_latency.py`` and
``bench/mcts_throughput.py`` (docs/decisions/0015 says which quoted figures
predate this path).

Differences from the reference, by design: a rollout search's phase times
are its waves' wall time, all in ``evaluate_ms`` (one kernel runs the four
phases); each tree's pool is allocated up front, one slot per simulation
of the call's cap beyond the largest tree passed in, at most ``max_nodes``
(176 bytes each), ``max_nodes`` for a search bounded by its deadline alone;
a tree passed in that holds more than ``max_nodes`` starts afresh (the
reference searches it further, with no room to grow).
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable

import cupy
import numpy as np

from search_service.backends import cuda_serves
from search_service.cuda import pool as pl
from search_service.cuda.tree_batch import CudaTreeBatch
from search_service.games.connect4 import Positions
from search_service.mcts.backend import LeafEvaluator, SearchParams, SearchResult
from search_service.mcts.batch import search_alone
from search_service.mcts.games import ConnectFourSearch
from search_service.mcts.plan import Member
from tandem import timeline
from tandem.deadline import Deadline


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


def _tree_slots(params: SearchParams, trees: list | None) -> int:
    """Node slots per tree of a ``search`` call: one per simulation of its cap
    beyond the largest tree passed in (a simulation adds one node at most),
    at most ``max_nodes``; ``max_nodes`` for a search bounded by its
    deadline alone."""
    if params.simulations is None:
        return params.max_nodes
    used = max((int(np.max(t.num_nodes)) for t in trees or () if t is not None), default=1)
    return min(params.max_nodes, used + params.simulations)


BACKUPS = ("warp_aggregated", "global_atomic")
SCALE_TABLE = 1 << 18  # UCT scale(N) = c_uct * sqrt(ln N) from NumPy for N below this (2 MiB)
STOP_SLICE_MS = 1.0  # a rollout search() polled by should_stop: its slice (ms) where rollout_slice_ms is unset
_LEAST_SLICE_MS = 1e-3  # a deadline already passed still gets a timed slice (0 ns would not be timed)


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
            waves of K simulations. A :meth:`search` call's slices are its
            own (module docstring), at most this long where it polls
            ``should_stop``.

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
        """Searches each of the B ``roots`` (unfinished positions) in its own
        tree: a private batch of trees (:meth:`open_batch`'s) that they join
        at once, stepped until every search has left (module docstring).

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
                tree built with another evaluator, or holding more than
                ``max_nodes`` nodes, is replaced by a fresh one.
            should_stop: called between waves (after the first); true ends the
                search there, like a deadline (``extras["stopped"]``). A
                rollout search, otherwise one launch, then runs in time slices
                (module docstring) with a check between them.
            device_waves: for ``value_model``, a
                :class:`search_service.evaluators.DeviceWaves` (a leaf
                channel's CUDA regions, lent to this call) or None. A wave
                whose B * K rows it carries goes by its regions: the
                selection kernel writes the leaves into its input region,
                one :meth:`~search_service.evaluators.DeviceWaves.evaluate`
                values them, and the backup kernel reads the values and
                priors from its output region (one small copy back a wave,
                no leaf on the host). The fresh roots' priors come from the
                first wave's ``evaluator`` call (no simulation in it).

        Returns:
            One result per root (``extras``: ``waves``, ``stopped``,
            ``warps_per_tree``, ``sims_per_warp``, ``backup``) and one
            :class:`CudaTree` per root, a compact copy of its tree (capacity:
            its node count).

        Raises:
            ValueError: a finished root, a tree rooted at another position, no
                ``evaluator`` for ``value_model``, an evaluator answer of the
                wrong shape, or a game the backend does not serve
                (:func:`refuse_other_games`). A game folder's game is searched
                by its module (:mod:`.game_batch`: rollouts, fresh trees,
                sliced as Connect Four's rollouts are).
        """
        timeline.mark("search.start")
        started = Deadline.now()  # the deadline counts from the call, tree set-up included
        refuse_other_games(params.game)
        b = len(params.game.as_states(roots))
        if isinstance(params.game, ConnectFourSearch):
            lend = None if device_waves is None else lambda: contextlib.nullcontext(device_waves)
            batch = CudaTreeBatch(self, params, evaluator, lend, cap=_tree_slots(params, trees), rows=b)
        else:  # a game folder's: its module, rollouts
            batch = _game_batch(self, params)
        batch.join(roots, trees, [params.seed] * b, list(range(b)))
        deadline = None if params.deadline_ms is None else Deadline.after_ms(params.deadline_ms, started)
        if params.evaluator != "value_model":  # rollouts; set now: the slice counts from the launch
            batch.slice_ms = self._search_slice_ms(deadline, should_stop)
        out = search_alone(batch, [Member(params.simulations, deadline, should_stop) for _ in range(b)])
        timeline.mark("search.end")
        return out

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

    # -- helpers ---------------------------------------------------------------------
    def _search_slice_ms(self, deadline: Deadline | None, should_stop) -> float:
        """The time slice (ms) of a ``search`` call's rollout waves: the time
        left to its ``deadline`` (a passed one: a token slice, one wave a
        tree), math.inf without one (untimed: each tree runs to its cap), so
        the whole search is one wave; at most ``rollout_slice_ms``
        (``STOP_SLICE_MS`` where unset) where ``should_stop`` is polled
        between waves."""
        left = math.inf if deadline is None else max(deadline.left_ms(), _LEAST_SLICE_MS)
        return left if should_stop is None else min(left, self.rollout_slice_ms or STOP_SLICE_MS)

    def split(self, k: int, value_model: bool = False) -> tuple[int, int]:
        """(W warps per tree, G simulations per warp) for K in flight."""
        g = min(k, self.value_sims_per_warp if value_model else self.sims_per_warp)
        return -(-k // g), g

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

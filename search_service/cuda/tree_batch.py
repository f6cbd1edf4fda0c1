"""Device trees that searches join and leave between waves: the CUDA
backend's :class:`~search_service.mcts.batch.TreeBatch`.

``CudaBackend.open_batch`` returns one; the search service's wave loop
steps it (docs/decisions/0001). Checked against the CPU reference by
tests/search/test_cuda_batch_gpu.py on the GPU.

Layout: one slab of ``S`` tree slots (rows ``0 .. B-1`` in use), each a
node pool of ``cap`` slots (``max_nodes``, or fewer where the batch is told:
a backend's own ``search`` call sizes its trees by its simulation cap;
pool.py's region), with its TS,
CYC, RES and INIT rows and, per row, a Philox key row (k0, k1, the tree's
index within its own call) and the wave's simulations (``ks``). The slab
doubles when a join needs more rows (the rows in use are copied); the rows
that leave below the new end are filled by the rows that stay past it (their
used slots, TS, CYC and key rows moved), so ``leave`` returns the new order.
Every row holds a whole pool of ``cap`` slots and the slab does not
shrink: a batch's memory is its most trees at once times ``cap * 176``
bytes.

A wave (``wave(ks)``):

* value model, by device waves (a leaf channel's CUDA regions lent for the
  wave, where every tree of the wave uses the model): ``mcts_vm_select``
  over the B rows with each tree's k (``ks``: slots ``j >= ks[b]`` are not
  written) writes the leaves into the channel's input region, the reward
  service values rows ``[0, B * K)``, ``mcts_vm_backup_*`` reads its output
  region; a wave the model fails is undone (``mcts_vm_undo``);
* value model, by the host (no channel, or some trees on rollouts): the META
  and OBS rows back to the host, one model call for the open leaves of the
  trees that use the model and Philox rollouts on the host for the others,
  the EVAL rows up, ``mcts_vm_backup_*``; where the model fails,
  ``mcts_vm_undo`` with the model's trees' k (the others 0) and the backup
  with the others' k;
* rollouts: one launch of ``mcts_rollout_*`` with each tree's budget (its
  simulations claimed so far + its k) and Philox key row; sliced (the
  backend's ``rollout_slice_ms``), the kernel also stops each warp once the
  slice has passed since the launch began (``deadline_ns``, from ``t0``,
  zeroed before each launch); a slice of ``math.inf`` is not timed (each
  tree runs to its budget).

A fresh value-model root joins waiting for its priors (``ready()`` False,
no simulation): the next wave's model call values it after that wave's
leaves (device waves: init_trees writes its OBS row at row ``B * K + i``
and ``mcts_vm_root_priors`` reads its logits; the host way: one more row of
the evaluator call, then init_trees with the priors), or a call of its own
where the wave has no simulation.

After each wave and each join ``finish_trees`` writes every row's RES row,
copied back: the trees' simulations done, node counts and roots' known
results (:meth:`live`), and, at ``leave``, their answers.
"""
from __future__ import annotations

import time

import cupy
import numpy as np

from search_service.cuda import abi
from search_service.cuda import pool as pl
from search_service.cuda.answers import call_model, model_values, result_fields, wave_slots
from search_service.cuda.module import kernel
from search_service.cuda.slab import Slab, fill_holes, grow, refresh, set_keys, slice_ns
from search_service.games import connect4
from search_service.games.connect4 import Positions
from search_service.mcts import tree as tr
from search_service.mcts.backend import EvaluationFailed, SearchParams, SearchResult, check_call, kept_trees
from search_service.mcts.batch import ended_by
from search_service.mcts.rollout import rollout_values

A = connect4.NUM_ACTIONS
_NULL = np.uint64(0)  # a null pointer argument of a kernel
_HOST_FIELDS = {  # per-row host state: name -> dtype (row b: tree b)
    "seed": np.uint64,
    "stream": np.int64,
    "current": np.uint64,  # the root's position
    "mask": np.uint64,
    "floor": np.int64,  # node slots in use at the join (a kept tree may hold more than max_nodes)
    "model_simulations": np.int64,
    "waves": np.int64,
    "reused": bool,
    "waiting": bool,  # a fresh root not yet valued: the next wave's model call brings its priors
    "use_model": bool,
    "failure": object,
    "ms": (np.float64, 4),  # select, expand, evaluate, backup: wall-clock ms of its waves
}


class CudaTreeBatch(Slab):
    """B device trees searched together (module docstring). Not thread-safe:
    one thread owns a batch and runs it on the current CuPy stream.

    Args:
        backend: the :class:`~search_service.cuda.backend.CudaBackend` (its
            backup variant, G, scale tables).
        params: the constants the trees share (their budgets are the members').
        evaluator: the leaf evaluator of value-model trees (host waves).
        lend: ``lend()`` -> a context manager of a
            :class:`~search_service.evaluators.DeviceWaves` or None, asked
            once a value-model wave: where it gives one that carries the
            wave's B * K rows and every tree of the wave uses the model, the
            selection writes the leaves into its input region and the backup
            reads the model's outputs from its output region (no leaf on the
            host); else the wave goes by the host.
        cap: node slots per tree, the most a tree may fill (None:
            ``params.max_nodes``); a tree passed in that holds more starts
            afresh. At most ``pool.MAX_CAPACITY``.
        rows: the slab's first rows (it doubles as trees join past them).
    """

    def __init__(self, backend, params: SearchParams, evaluator=None, lend=None, *, cap: int | None = None,
                 rows: int = 8):
        if params.evaluator == "value_model" and evaluator is None:
            raise ValueError("evaluator 'value_model' needs a leaf evaluator")
        self.backend, self.p, self.evaluator = backend, params, evaluator
        # lend(): a context manager giving a DeviceWaves (the leaf channel's CUDA regions) or None,
        # per wave (search_service/evaluators.py HandoffEvaluator.lend); None: every wave by the host.
        self.lend = lend
        self.k_max = params.parallel_sims
        self.puct = params.evaluator == "value_model"
        # Rollout waves last a time slice (search_service/mcts/plan.py), or None: k each.
        self.slice_ms = None if self.puct else backend.rollout_slice_ms
        self.w, self.g = backend.split(self.k_max, self.puct)
        self.cap = min(params.max_nodes if cap is None else cap, pl.MAX_CAPACITY)
        self.slots = 0  # S: rows the slab holds
        self.b = 0  # B: rows in use
        self.row = {name: np.zeros(0, dt) if not isinstance(dt, tuple) else np.zeros((0, dt[1]), dt[0])
                    for name, dt in _HOST_FIELDS.items()}
        self.res = np.zeros(0, abi.RESULT.dtype)  # the RES rows as of the last refresh
        self._grow(max(rows, 1))

    def __len__(self) -> int:
        return self.b

    # -- the slab ------------------------------------------------------------------------
    def _grow(self, slots: int) -> None:
        """Makes room for ``slots`` rows, the rows in use copied."""
        if slots <= self.slots:
            return
        slots = max(slots, 2 * self.slots)
        n, k = slots, self.k_max
        grow(self, n, self.cap * pl.NODE_BYTES, abi.RESULT.nbytes, abi.INIT.words)
        if self.puct:
            sizes = (n * k * abi.META.nbytes, n * k * abi.OBS.nbytes)
            self.stage = cupy.empty(sum(sizes), np.uint8)
            meta, obs = abi.carve(self.stage, *sizes)
            self.meta_dev, self.obs_dev = meta, obs.reshape(n * k, abi.OBS.words)
            self.paths = cupy.empty(n * k * abi.MAX_DEPTH, np.int32)
            self.vin_dev = cupy.empty(n * k * abi.EVAL.words, np.float32)
        self.slots = slots

    def _ptr(self, row: int) -> int:
        return self.pool.data.ptr + row * self.cap * pl.NODE_BYTES

    def _refresh(self) -> None:
        refresh(self, kernel("finish_trees"), self.cap, abi.RESULT)

    # -- TreeBatch (done, live: Slab's) ----------------------------------------------------
    def ready(self) -> np.ndarray:
        return ~self.row["waiting"]

    def failed(self) -> np.ndarray:
        return self.row["failure"] != ""

    def join(self, roots: Positions, trees: list | None, seeds: list[int], streams: list[int]) -> None:
        p = self.p
        trees = check_call(roots, p, self.evaluator, trees)
        n = len(roots)
        kept = {i: t for i, t in kept_trees(roots, trees, p.evaluator, pl.as_cuda_tree).items()
                if t.num_nodes <= self.cap}  # a larger one (a smaller max_nodes since) starts afresh
        fresh = np.array([i not in kept for i in range(n)])
        init = np.zeros(n, abi.INIT.dtype)
        init["current"], init["mask"] = roots.current, roots.mask
        init["nodes"] = [kept[i].num_nodes if i in kept else 1 for i in range(n)]
        init["fresh"] = fresh
        # Fresh PUCT roots wait for their priors: the next wave's model call brings them (_value_roots).
        waiting = fresh & self.puct
        init["root_visits"][waiting] = 1  # the root's own evaluation: sqrt(N) > 0 at the first choice
        first = self.b
        self._grow(first + n)
        for i, tree in kept.items():
            pl.copy_into(self._ptr(first + i), self.cap, tree)
        self.init_dev[first * abi.INIT.words : (first + n) * abi.INIT.words].set(init.view(np.uint32))
        seed = set_keys(self, first, seeds, streams)
        ts_at, cyc_at = first * abi.TREE_STATE.words, first * abi.CYCLES.words
        kernel("init_trees")(
            ((n + 127) // 128,), (128,),
            (self.pool[first:], np.int64(self.cap), np.int32(n), self.init_dev[first * abi.INIT.words :],
             self.ts[ts_at:], self.cyc[cyc_at:], self.t0, _NULL))
        added = {name: np.zeros((n, *self.row[name].shape[1:]), self.row[name].dtype) for name in _HOST_FIELDS}
        added["seed"][:], added["stream"][:] = seed, streams
        added["current"][:], added["mask"][:] = roots.current, roots.mask
        added["floor"][:] = init["nodes"]
        added["reused"][:] = ~fresh
        added["waiting"][:] = waiting
        added["use_model"][:], added["failure"][:] = self.puct, ""
        self.row = {name: np.concatenate([self.row[name], added[name]]) for name in _HOST_FIELDS}
        self.b += n
        self._refresh()

    def wave(self, ks: np.ndarray) -> bool:
        return self._model_wave(ks) if self.puct else self._rollout_wave(ks)

    def leave(self, rows: list[int], members: list) -> tuple[list[SearchResult], list[pl.CudaTree], np.ndarray]:
        index = np.asarray(rows, np.int64)
        results = self._results(index, [ended_by(m) for m in members])
        nodes = self._nodes()
        trees = []
        for i, m in zip(rows, members):  # a compact copy of each tree that is kept (capacity: its node count)
            if not m.keep_tree:  # no session keeps it: no copy (a launch and an allocation each)
                trees.append(None)
                continue
            n = int(nodes[i])
            dst = cupy.empty((1, n * pl.NODE_BYTES), np.uint8)
            src = pl.CudaTree(self.pool, i, self.cap, n, 0, 0)
            pl.copy_into(dst.data.ptr, n, src)
            trees.append(pl.CudaTree(dst, 0, n, n, int(self.row["current"][i]), int(self.row["mask"][i]),
                                     self.p.evaluator))
        order = fill_holes(self, set(rows), lambda hole, row: pl.copy_into(
            self._ptr(hole), self.cap, pl.CudaTree(self.pool, row, self.cap, int(nodes[row]), 0, 0)))
        self.row = {name: values[order] for name, values in self.row.items()}
        self.res = self.res[order]
        self.b = len(order)
        return results, trees, order

    # -- inside ---------------------------------------------------------------------------
    def _nodes(self) -> np.ndarray:
        """int64 [B]: slots in use per tree (claims past the node limit were refused)."""
        return np.minimum(self.res["nodes"].astype(np.int64), np.maximum(self.cap, self.row["floor"]))

    def _results(self, index: np.ndarray, ends: list[tuple[bool, bool]]) -> list[SearchResult]:
        res, row, nodes = self.res[index], {k: v[index] for k, v in self.row.items()}, self._nodes()[index]

        def root_priors(total: np.ndarray) -> np.ndarray | None:
            if total.all():
                return None
            start = pl.offsets(self.cap)[0]
            rows = self.pool[cupy.asarray(index), start : start + abi.NODE_ROW.itemsize].get()
            return np.ascontiguousarray(rows).view(abi.NODE_ROW)["edges"]["prior"].reshape(len(index), A)

        return [
            SearchResult(
                **fields, tree_nodes=int(nodes[i]), deadline_reached=ends[i][0],
                select_ms=float(row["ms"][i, 0]), expand_ms=float(row["ms"][i, 1]),
                evaluate_ms=float(row["ms"][i, 2]), backup_ms=float(row["ms"][i, 3]),
                tree_reused=bool(row["reused"][i]), model_simulations=int(row["model_simulations"][i]),
                evaluation_failure=row["failure"][i],
                extras={"waves": int(row["waves"][i]), "stopped": ends[i][1], "warps_per_tree": self.w,
                        "sims_per_warp": self.g, "backup": self.backend.backup},
            )
            for i, (fields, _) in enumerate(result_fields(res, row["current"], row["mask"], root_priors))
        ]

    def _vm_args(self, k_wave: int) -> tuple:
        return (self.pool, np.int64(self.cap), np.int32(self.cap), np.int32(self.b), np.int32(self.w),
                np.int32(self.g), np.int32(self.k_max), np.int32(k_wave))

    def _grid(self) -> tuple[tuple[int], tuple[int]]:
        warps = self.b * self.w
        return ((warps + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,), (32 * abi.WARPS_PER_BLOCK,)

    def _model_wave(self, ks: np.ndarray) -> bool:
        if not ks.any():  # roots waiting for their priors, and no simulation to go with them
            return self._value_roots_alone()
        n = self.b * self.k_max + int(self.row["waiting"].sum())
        if self.lend is None or not self.row["use_model"][ks > 0].all():
            return self._host_wave(ks)
        with self.lend() as dw:
            if dw is None or not dw.carries(n):
                return self._host_wave(ks)
            return self._device_wave(ks, dw)

    # -- the roots waiting for their priors (ready() False) --------------------------------
    def _root_init(self, rows: np.ndarray, priors: np.ndarray | None = None) -> np.ndarray:
        """INIT rows (abi.INIT.dtype [M]) that make fresh trees of ``rows``' roots
        (int [M]), valued (root N 1), with ``priors`` float32 [M, A] where given."""
        init = np.zeros(len(rows), abi.INIT.dtype)
        init["current"], init["mask"] = self.row["current"][rows], self.row["mask"][rows]
        init["nodes"], init["fresh"], init["root_visits"] = 1, 1, 1
        if priors is not None:
            init["has_priors"], init["priors"] = 1, priors
        return init

    def _by_runs(self, rows: np.ndarray, launch) -> None:
        """``launch(row, i, count)`` per run of consecutive rows in ``rows`` (int
        [M], ascending): rows ``row .. row + count - 1`` are ``rows[i : i + count]``."""
        i = 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and rows[j] == rows[j - 1] + 1:
                j += 1
            launch(int(rows[i]), i, j - i)
            i = j

    def _reinit(self, rows: np.ndarray, init_dev, obs=None) -> None:
        """Queues init_trees over ``rows`` (int [M], ascending, untouched since
        they joined) from ``init_dev`` (their INIT rows on the device, in
        order), each root's OBS row into ``obs`` row i where given."""
        ts_w, cyc_w, words = abi.TREE_STATE.words, abi.CYCLES.words, abi.INIT.words
        self._by_runs(rows, lambda r, i, c: kernel("init_trees")(
            ((c + 127) // 128,), (128,),
            (self.pool[r:], np.int64(self.cap), np.int32(c), init_dev[i * words :], self.ts[r * ts_w :],
             self.cyc[r * cyc_w :], self.t0, _NULL if obs is None else obs[i:])))

    def _roots_valued(self, rows: np.ndarray, ms: float, failure: EvaluationFailed | None) -> None:
        """Bookkeeping once the model call of the roots ``rows`` is done (failed:
        uniform priors stay and their leaves go to rollouts)."""
        self.row["waiting"][rows] = False
        self.row["ms"][rows, 2] += ms
        if failure is not None:
            self.row["use_model"][rows] = False
            self.row["failure"][rows] = str(failure) or type(failure).__name__

    def _value_roots_alone(self) -> bool:
        """The roots waiting, valued by a call of their own (a wave with no
        simulation); False if the model failed them."""
        rows = np.flatnonzero(self.row["waiting"])
        if not rows.size:
            return True
        t = time.perf_counter()
        failure = None
        try:
            _, priors = call_model(self.evaluator, self.row["current"][rows], self.row["mask"][rows])
        except EvaluationFailed as exc:
            failure, priors = exc, None
        self._reinit(rows, cupy.asarray(self._root_init(rows, priors).view(np.uint32)))
        self._roots_valued(rows, (time.perf_counter() - t) * 1e3, failure)
        self._refresh()
        return failure is None

    def _select(self, ks: np.ndarray, obs) -> tuple:
        """Queues the selection of wave ``ks`` (OBS rows into ``obs``): its kernels' (grid, block, args)."""
        grid, block = self._grid()
        args = self._vm_args(int(ks.max()))
        self.ks_dev[: self.b].set(ks.astype(np.int32))
        kernel("mcts_vm_select")(grid, block, (*args, np.float64(self.p.c_puct), np.float64(self.p.virtual_loss),
                                               self.ts, self.meta_dev, self.paths, obs, self.ks_dev))
        return grid, block, args

    def _backup_kernel(self):
        return kernel("mcts_vm_backup_aggregated" if self.backend.backup == "warp_aggregated"
                      else "mcts_vm_backup_global")

    def _count(self, ks: np.ndarray, backed: np.ndarray, used: np.ndarray, ms: tuple[float, float, float]) -> None:
        """A wave's bookkeeping: ``backed`` (int64 [B]) simulations backed up per
        tree, ``used`` (bool [B]) the trees the model valued, ``ms`` its select,
        evaluate and backup times."""
        done = backed > 0
        self.row["ms"][done] += np.array([ms[0], 0.0, ms[1], ms[2]])
        self.row["model_simulations"] += np.where(used, ks, 0)
        self.row["waves"] += done

    def _device_wave(self, ks: np.ndarray, dw) -> bool:
        """A wave whose leaves and model outputs stay on the device (``dw``'s
        regions): the leaves at rows ``[0, B * K)``, the roots waiting for their
        priors after them (init_trees writes their OBS rows, mcts_vm_root_priors
        reads their logits)."""
        n = self.b * self.k_max
        roots = np.flatnonzero(self.row["waiting"])
        t = time.perf_counter()
        inputs = dw.inputs.reshape(-1, abi.OBS.words)
        obs = inputs[:n]
        grid, block, args = self._select(ks, obs)
        if roots.size:  # untouched since they joined: written afresh, with their OBS rows
            root_init = cupy.asarray(self._root_init(roots).view(np.uint32))
            self._reinit(roots, root_init, inputs[n:])
        dw.inputs_written()  # an ordered channel: the reward service's copy waits for the selection
        if not dw.ordered:  # else the channel's event orders the selection before the model's copy
            cupy.cuda.get_current_stream().synchronize()
        t1 = time.perf_counter()
        try:
            values, logits = dw.evaluate(n + roots.size)
        except EvaluationFailed as exc:
            t2 = time.perf_counter()
            kernel("mcts_vm_undo")(grid, block, (*args, self.ts, self.meta_dev, self.paths, self.ks_dev))
            used = ks > 0
            self.row["use_model"][used] = False
            self.row["failure"][used] = str(exc) or type(exc).__name__
            self.row["ms"][used, 2] += (t2 - t1) * 1e3
            self._roots_valued(roots, (t2 - t1) * 1e3, exc)  # uniform priors stay
            self._refresh()
            return False
        t2 = time.perf_counter()
        self._backup_kernel()(grid, block, (*args, self.ts, self.meta_dev, self.paths, self.vin_dev, np.int32(0),
                                            np.int32(1), values, _NULL if logits is None else logits, obs,
                                            self.ks_dev))
        if roots.size and logits is not None:  # without a policy head the uniform priors stay
            words = abi.INIT.words
            self._by_runs(roots, lambda r, i, c: kernel("mcts_vm_root_priors")(
                ((c + 127) // 128,), (128,),
                (self.pool[r:], np.int64(self.cap), np.int32(c), root_init[i * words :], inputs[n + i :],
                 logits[n + i :])))
        self._roots_valued(roots, (t2 - t1) * 1e3, None)
        self._refresh()
        t3 = time.perf_counter()
        self._count(ks, ks, ks > 0, ((t1 - t) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
        return True

    def _host_wave(self, ks: np.ndarray) -> bool:
        """A wave whose leaves come to the host: the model's by one evaluator call, the others' by rollouts."""
        b, k = self.b, self.k_max
        n = b * k
        t = time.perf_counter()
        grid, block, args = self._select(ks, self.obs_dev)
        meta = self.meta_dev[: n * abi.META.nbytes].get().view(abi.META.dtype)  # waits for the selection
        planes = self.obs_dev[:n].get().reshape(n, 2, connect4.ROWS, connect4.COLUMNS)
        t1 = time.perf_counter()
        slot = np.arange(n)
        tree_of, j = slot // k, slot % k
        in_wave = j < ks[tree_of]
        ran, _, open_ = wave_slots(meta, in_wave, b)  # slots past a tree's k hold no META row: never read
        vin = np.zeros(n, abi.EVAL.dtype)
        vin["value"] = tr.OUTCOME_VALUE[np.where(ran, meta["terminal"], tr.NOT_TERMINAL)]
        by_model = self.row["use_model"][tree_of]
        roll = open_ & ~by_model
        if roll.any():
            pos = connect4.from_observation(planes[roll])
            t_of = tree_of[roll]
            vin["value"][roll] = rollout_values(pos.current, pos.mask, self.done[t_of] + j[roll],
                                                self.row["stream"][t_of], self.row["seed"][t_of])
            # Their new nodes keep the uniform priors where the backup writes the model's (one flag a launch).
            lead = roll & (meta["leader"] == slot)
            vin["priors"][lead] = tr.init_edges(pos.mask[lead[roll]], np.zeros(int(lead.sum()), np.int8))[1]
        used = self.row["use_model"] & (ks > 0)
        has_priors, failure, root_priors = False, None, None
        roots = np.flatnonzero(self.row["waiting"])
        try:
            has_priors, root_priors = model_values(
                self.evaluator, vin, planes, self.obs_dev, open_ & by_model, meta["leader"],
                bool(getattr(self.evaluator, "accepts_cupy", False)),
                roots=(self.row["current"][roots], self.row["mask"][roots]))
        except EvaluationFailed as exc:
            failure = exc
        t2 = time.perf_counter()
        if roots.size:  # untouched since they joined: written afresh, with their priors
            self._reinit(roots, cupy.asarray(self._root_init(roots, root_priors).view(np.uint32)))
            self._roots_valued(roots, (t2 - t1) * 1e3, failure)
        backed = ks
        if failure is not None:  # the model's trees undo the wave; those on rollouts keep theirs
            self.ks_dev[:b].set(np.where(used, ks, 0).astype(np.int32))
            kernel("mcts_vm_undo")(grid, block, (*args, self.ts, self.meta_dev, self.paths, self.ks_dev))
            backed = np.where(used, 0, ks)
            self.ks_dev[:b].set(backed.astype(np.int32))
            self.row["use_model"][used] = False
            self.row["failure"][used] = str(failure) or type(failure).__name__
            self.row["ms"][used, 2] += (t2 - t1) * 1e3
            has_priors, used = False, np.zeros(b, bool)
        self.vin_dev[: n * abi.EVAL.words].set(vin.view(np.float32))
        self._backup_kernel()(grid, block, (*args, self.ts, self.meta_dev, self.paths, self.vin_dev,
                                            np.int32(has_priors), np.int32(0), _NULL, _NULL, _NULL, self.ks_dev))
        self._refresh()
        t3 = time.perf_counter()
        self._count(ks, backed, used, ((t1 - t) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
        return failure is None

    def _rollout_wave(self, ks: np.ndarray) -> bool:
        b, g = self.b, self.g
        t = time.perf_counter()
        # Each tree may have claimed its simulations so far (all completed: the last launch ended) + its k.
        self.ks_dev[:b].set((self.done + ks).astype(np.int32))
        deadline_ns = slice_ns(self.slice_ms)
        if deadline_ns:
            self.t0.fill(0)  # the slice counts from this launch's first warp
        grid, block = self._grid()
        scale = self.backend.scale_table(self.p.c_uct)  # float64 [SCALE_TABLE]
        smem = abi.COLUMN_TABLE_BYTES + abi.WARPS_PER_BLOCK * (g * abi.MAX_DEPTH + 64) * 4
        name = "mcts_rollout_aggregated" if self.backend.backup == "warp_aggregated" else "mcts_rollout_global"
        kernel(name)(grid, block, (
            self.pool, np.int64(self.cap), np.int32(self.cap), np.int32(b), np.int32(self.w), np.int32(g),
            np.int32(self.k_max), np.int32(0), np.int64(deadline_ns), self.t0, self.ts, self.cyc,
            np.float64(self.p.c_uct), np.float64(self.p.virtual_loss), scale, np.int32(scale.size),
            np.uint32(0), np.uint32(0), self.ks_dev, self.keys), shared_mem=smem)
        self._refresh()
        ms = (time.perf_counter() - t) * 1e3
        done = ks > 0
        self.row["ms"][done, 2] += ms  # one kernel: select, expand, rollouts and backup inside
        self.row["waves"] += done  # slices, where sliced
        return True



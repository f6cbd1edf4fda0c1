"""Device trees of a game folder's game (a :class:`~search_service.mcts.games.PluginSearch`
with ``rules.cu``): the CUDA backend's :class:`~search_service.mcts.batch.TreeBatch`
for games other than Connect Four, searched with rollouts by the game's
own module (:mod:`.game_module`).

The same slab as :class:`~.tree_batch.CudaTreeBatch` (read its docstring):
``S`` tree rows, each a node pool of ``cap`` slots of the game's
``NODE_BYTES`` (:class:`~.game_abi.GameAbi`), TS, CYC, RES and INIT rows, a
Philox key row per tree; a wave is one launch of ``mcts_rollout_*`` with each
tree's budget, sliced by the backend's ``rollout_slice_ms`` (a ``search``
call's: the whole search, one launch); ``finish_trees``
after each wave and join. With one warp per tree (G >= K) a tree is searched
in the CPU reference's order, so its results equal the reference's
(:class:`~search_service.mcts.cpu_reference.CpuReferenceBackend` over the
same folder) for the same seed.

Not (yet) on the device for these games: the value model (refused: the
games are searched with rollouts) and tree reuse (a tree passed in is
replaced by a fresh one, ``tree_reused`` False, and ``leave`` gives no tree
back: a session searches each move afresh).
"""
from __future__ import annotations

import time

import numpy as np

from search_service.cuda import abi
from search_service.cuda.answers import game_result_fields
from search_service.cuda.game_module import GameModule
from search_service.cuda.slab import Slab, fill_holes, grow, refresh, set_keys, slice_ns
from search_service.mcts import tree as tr
from search_service.mcts.backend import SearchParams, SearchResult, check_call
from search_service.mcts.batch import ended_by

_NULL = np.uint64(0)
_STATIC_SMEM = 48 * 1024  # dynamic shared memory a launch may use without opting in


class GameTreeBatch(Slab):
    """B device trees of one game folder's game (module docstring). Not
    thread-safe: one thread owns a batch and runs it on the current CuPy stream.

    Args:
        backend: the :class:`~search_service.cuda.backend.CudaBackend` (backup variant, G, scale tables).
        params: the constants the trees share; ``params.game`` the game.
        module: the game's compiled module.

    Raises:
        ValueError: ``value_model`` (these games are searched with rollouts on the GPU).
    """

    def __init__(self, backend, params: SearchParams, module: GameModule):
        if params.evaluator == "value_model":
            raise ValueError(f"game {params.game.name}: the CUDA backend searches it with rollouts only")
        self.backend, self.p, self.mod, self.abi = backend, params, module, module.abi
        self.game = params.game
        self.k_max = params.parallel_sims
        self.slice_ms = backend.rollout_slice_ms
        self.w, self.g = backend.split(self.k_max)
        self.cap = min(params.max_nodes, (1 << 31) // self.abi.row - 2)  # node * ROW + action fits an int32
        # Slots per tree region (the kernels' `cap`; `cap` stays the node limit): a node is 8 mod 16
        # bytes where 8 * STATE_WORDS is, so an odd count would start every other tree's int4
        # records 8 bytes off their alignment (a misaligned-address fault on the GPU).
        self.region = self.cap + (self.cap & 1) * (self.abi.node_bytes % 16 // 8)
        self.smem = self.abi.smem_bytes(self.g)
        self.slots = self.b = 0
        self.states = np.zeros((0, self.abi.state_words), np.uint64)  # the roots
        self.seed = np.zeros(0, np.uint64)
        self.waves = np.zeros(0, np.int64)
        self.ms = np.zeros(0, np.float64)
        self.res = np.zeros(0, self.abi.result.dtype)
        # One row to start (the slab doubles as trees join): a row is max_nodes whole nodes, 26 times
        # Connect Four's for Gomoku (200,000 x 4,632 bytes = 0.93 GB), so the 8 rows CudaTreeBatch
        # starts with would take 7.4 GB for a service's one-tree warm-up search.
        self._grow(1)

    def __len__(self) -> int:
        return self.b

    def _grow(self, slots: int) -> None:
        if slots <= self.slots:
            return
        n = max(slots, 2 * self.slots)
        grow(self, n, self.region * self.abi.node_bytes, self.abi.result.nbytes, self.abi.init.words)
        self.slots = n

    def _refresh(self) -> None:
        refresh(self, self.mod.kernel("finish_trees"), self.region, self.abi.result)

    # -- TreeBatch (done, live: Slab's) ----------------------------------------------------
    def ready(self) -> np.ndarray:
        return np.ones(self.b, bool)  # rollouts only: no root waits for priors

    def failed(self) -> np.ndarray:
        return np.zeros(self.b, bool)

    def join(self, roots, trees: list | None, seeds: list[int], streams: list[int]) -> None:
        check_call(roots, self.p, None, trees)
        states = self.game.as_states(roots)
        n, first = len(states), self.b
        init = np.zeros(n, self.abi.init.dtype)
        init["nodes"], init["fresh"] = 1, 1
        init["state"] = states.reshape(init["state"].shape)  # a one-word state's field is a scalar: [n], not [n, 1]
        self._grow(first + n)
        a = self.abi
        self.init_dev[first * a.init.words : (first + n) * a.init.words].set(init.view(np.uint32))
        seed = set_keys(self, first, seeds, streams)
        self.mod.kernel("init_trees")(
            ((n + 127) // 128,), (128,),
            (self.pool[first:], np.int64(self.region), np.int32(n), self.init_dev[first * a.init.words :],
             self.ts[first * abi.TREE_STATE.words :], self.cyc[first * abi.CYCLES.words :], self.t0, _NULL))
        self.states = np.concatenate([self.states, states])
        self.seed = np.concatenate([self.seed, seed])
        self.waves = np.concatenate([self.waves, np.zeros(n, np.int64)])
        self.ms = np.concatenate([self.ms, np.zeros(n)])
        self.b += n
        self._refresh()

    def wave(self, ks: np.ndarray) -> bool:
        b, g = self.b, self.g
        t = time.perf_counter()
        self.ks_dev[:b].set((self.done + ks).astype(np.int32))
        deadline_ns = slice_ns(self.slice_ms)
        if deadline_ns:
            self.t0.fill(0)
        warps = b * self.w
        grid, block = ((warps + abi.WARPS_PER_BLOCK - 1) // abi.WARPS_PER_BLOCK,), (32 * abi.WARPS_PER_BLOCK,)
        scale = self.backend.scale_table(self.p.c_uct)
        fn = self.mod.kernel("mcts_rollout_aggregated" if self.backend.backup == "warp_aggregated"
                             else "mcts_rollout_global")
        if self.smem > _STATIC_SMEM:  # long games with many simulations a warp: opt in to more shared memory
            fn.max_dynamic_shared_size_bytes = self.smem
        fn(grid, block, (
            self.pool, np.int64(self.region), np.int32(self.cap), np.int32(b), np.int32(self.w), np.int32(g),
            np.int32(self.k_max), np.int32(0), np.int64(deadline_ns), self.t0, self.ts, self.cyc,
            np.float64(self.p.c_uct), np.float64(self.p.virtual_loss), scale, np.int32(scale.size),
            np.uint32(0), np.uint32(0), self.ks_dev, self.keys), shared_mem=self.smem)
        self._refresh()
        done = ks > 0
        self.ms[done] += (time.perf_counter() - t) * 1e3
        self.waves += done
        return True

    def leave(self, rows: list[int], members: list) -> tuple[list[SearchResult], list, np.ndarray]:
        index = np.asarray(rows, np.int64)
        results = self._results(index, [ended_by(m) for m in members])
        nodes = np.minimum(self.res["nodes"].astype(np.int64), self.cap)
        parts = list(zip(pl_offsets(self.region, self.abi), (self.abi.rows_bytes, self.abi.child_bytes,
                                                             self.abi.pos_bytes)))

        def move_tree(hole: int, row: int) -> None:  # its used slots
            used = int(nodes[row])
            for part, size in parts:
                self.pool[hole, part : part + used * size] = self.pool[row, part : part + used * size]

        order = fill_holes(self, set(rows), move_tree)
        self.states, self.seed, self.waves, self.ms = (x[order] for x in (self.states, self.seed, self.waves, self.ms))
        self.res = self.res[order]
        self.b = len(order)
        return results, [None] * len(rows), order

    def _results(self, index: np.ndarray, ends: list[tuple[bool, bool]]) -> list[SearchResult]:
        res, states = self.res[index], self.states[index]
        legal = self.game.legal(states)

        def root_priors(total: np.ndarray) -> np.ndarray | None:  # uniform over the legal actions (tree.edges)
            return None if total.all() else tr.edges(legal, self.game.terminal_code(states))[1]

        nodes = np.minimum(res["nodes"].astype(np.int64), self.cap)
        return [
            SearchResult(**fields, tree_nodes=int(nodes[i]), deadline_reached=ends[i][0],
                         evaluate_ms=float(self.ms[index[i]]), tree_reused=False,
                         extras={"waves": int(self.waves[index[i]]), "stopped": ends[i][1], "warps_per_tree": self.w,
                                 "sims_per_warp": self.g, "backup": self.backend.backup, "game": self.game.name})
            for i, (fields, _) in enumerate(game_result_fields(res, legal, self.game.loses_at_once(states),
                                                               root_priors))
        ]


def pl_offsets(cap: int, game_abi) -> tuple[int, int, int]:
    """Byte offsets of rows, child and pos in a pool region of ``cap`` slots of the game's nodes."""
    return 0, cap * game_abi.rows_bytes, cap * (game_abi.rows_bytes + game_abi.child_bytes)


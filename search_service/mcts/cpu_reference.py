"""The CPU reference MCTS: B trees searched together with NumPy.

The trees are a :class:`CpuTreeBatch`, which searches join and leave between
waves (search_service/mcts/batch.py): a ``search`` call joins its B roots to
a batch of its own and steps it until every tree is done; the search
service's wave loop steps one batch of every search in flight. Each tree has
its own budget (:mod:`search_service.mcts.plan`), seed and statistics.

Algorithm (one *wave* per loop, K = ``parallel_sims`` simulations per tree):

1. **Select** (Chaslot et al. 2008, "Parallel Monte-Carlo tree search", and
   Segal 2010, "On the scalability of parallel UCT", for virtual loss). The K
   selections of a tree descend from the root one after another in simulation
   order, each seeing the virtual loss of the earlier ones: an edge with ``v``
   simulations in flight counts ``v`` extra visits, each a loss of
   ``virtual_loss`` for the player choosing there. At a node, the player to
   move picks among legal edges by

   * UCT (Kocsis & Szepesvari 2006, "Bandit based Monte-Carlo planning"),
     with rollouts: an unvisited edge first (lowest index), else the maximum
     of ``Q + c_uct * sqrt(ln N / n)``;
   * PUCT (Rosin 2011; Silver et al. 2017, AlphaZero), with the value model:
     the maximum of ``Q + c_puct * P * sqrt(N) / (1 + n)``, Q = 0 unvisited;

   with n, Q the edge's visits and mean value (virtual loss included), Q from
   the choosing player's view, N the node's visits (simulations that went
   through or ended at it; a PUCT root also counts its own evaluation) plus
   its edges' virtual losses, ties to the lowest index. Evaluated in float64
   exactly as ``Q + (c_uct * sqrt(ln max(N, 1))) * (1 / sqrt(max(n, 1)))``
   and ``Q + sqrt(N) * ((c_puct * P) / (1 + n))``, with
   ``Q = (W - virtual_loss * v) / max(n, 1)``, v the edge's virtual losses.
   A selection stops at an edge whose child is not in the tree, or at a
   finished position.
   All B*K selections run in lockstep by depth; where several selections of a
   wave stand on one node they choose in simulation order ("rank"), so the
   result is exactly that of running them one after another.
2. **Expand**: each distinct edge where selections stopped gets one new node
   (so a wave adds at most K nodes per tree); once a tree's pool holds
   ``max_nodes`` nodes the leaf is evaluated without being added and the
   result says ``pool_exhausted``.
3. **Evaluate**: finished positions exactly (side to move lost: -1, draw: 0);
   others by one random rollout per simulation (Philox, see
   :mod:`search_service.mcts.philox`) or by the value model, called once per
   wave with every distinct leaf of every tree. Its priors (masked to legal
   moves, renormalised; uniform when absent) become the new nodes' priors.
   If the model cannot value a wave (:class:`EvaluationFailed`: its service
   failed, or could not answer by the deadline), the wave is undone -- its
   virtual losses released, the nodes it added unlinked, nothing backed up --
   and the search goes on *in the same tree* with rollouts at the leaves while
   budget is left (the fallback of AlphaGo, Silver et al. 2016, which mixed
   rollouts and a value network); past the deadline it answers at once from
   the tree it has. ``SearchResult.model_simulations`` counts the simulations
   the model valued, ``evaluation_failure`` says why it stopped.
4. **Backup**: every edge on the path gains a visit and the value, signed for
   the player choosing at that edge (negamax); the virtual loss is removed.
5. **Solve** (MCTS-Solver, Winands, Bjornsson & Saito 2008): terminal results
   are propagated up the wave's paths, deepest first, as proven results
   (:func:`search_service.mcts.tree.solve`): a node with a lost child is a
   proven win, a node whose legal children are all known takes the best of
   them. A selection stops at a proven node as at a terminal one and backs up
   its exact value (so a move proven lost soon has the worst Q); a tree whose
   root is proven takes no more simulations, and the search plays the proof
   (:func:`search_service.mcts.backend.best_action`: a proven win at once,
   never a move proven lost unless all are).

With ``parallel_sims = 1`` this is plain sequential MCTS; with a fixed seed the
search is deterministic for any ``parallel_sims``. The budget is checked
between waves: the last wave is cut short so exactly ``simulations`` run, and
a ``deadline_ms`` (counted from the call, tree set-up included) ends the
search before a wave expected to end past it (:class:`~search_service.mcts.plan.WaveTimes`:
as long as the longest of the last eight but a stall; at least one wave always runs), and so
does ``should_stop()`` returning true (the caller went away: the server passes
"the RPC is no longer active"). For PUCT a fresh root is evaluated before
its first simulation (for its priors; not a simulation), by the model call
of the batch's next wave, beside that wave's leaves (a root-only call where
the wave has none).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from search_service.mcts import tree as tr
from search_service.mcts.backend import (
    EvaluationFailed,
    LeafEvaluator,
    SearchParams,
    SearchResult,
    best_action,
    check_call,
    kept_trees,
    model_answer,
)
from search_service.mcts.batch import ended_by, search_alone, sliced_waves
from search_service.mcts.plan import Member
from tandem import nvtx
from tandem.deadline import Deadline

_INITIAL_CAPACITY = 4096  # slots per tree before the pool first grows


class CpuReferenceBackend:
    """NumPy MCTS (see the module docstring). Stateless between calls.

    Args:
        rollout_slice_ms: where set, rollout searches run sliced waves of this
            many ms (search_service/mcts/plan.py): a search bounded by its
            deadline alone takes waves of K until the slice has passed, and
            searches join and leave between slices. None: one wave of K each.
    """

    name = "cpu_reference"

    def __init__(self, rollout_slice_ms: float | None = None):
        self.rollout_slice_ms = rollout_slice_ms

    def search(
        self,
        roots,
        params: SearchParams,
        evaluator: LeafEvaluator | None = None,
        trees: list[tr.Tree | None] | None = None,
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> tuple[list[SearchResult], list[tr.Tree]]:
        """Searches each of the B ``roots`` (unfinished positions) in its own tree.

        Args:
            roots: B positions of ``params.game`` (Connect Four:
                :class:`~search_service.games.connect4.Positions`; a game
                plug-in: its states, uint64 [B, W]).
            params: budget and constants.
            evaluator: the leaf evaluator; required for ``value_model``, ignored otherwise.
            trees: per root, a single tree rooted at it (from ``reroot``) to search
                further, or None for a fresh one. Trees passed in are copied,
                not modified. A tree built with another evaluator (or game) is replaced.
            should_stop: called between waves (after the first); true ends the
                search there, like a deadline, and the results' ``extras`` say
                ``stopped``. None: only the budget ends it.

        Returns:
            One result and one single tree (batch of 1) per root.

        Raises:
            ValueError: a finished root, a tree rooted at another position, or
                no ``evaluator`` for ``value_model``.
        """
        started = Deadline.now()  # the deadline counts from the call, tree set-up included
        batch = self.open_batch(params, evaluator)
        b = len(params.game.as_states(roots))
        batch.join(roots, trees, [params.seed] * b, list(range(b)))
        deadline = None if params.deadline_ms is None else Deadline.after_ms(params.deadline_ms, started)
        return search_alone(batch, [Member(params.simulations, deadline, should_stop) for _ in range(b)])

    def open_batch(self, params: SearchParams, evaluator: LeafEvaluator | None = None) -> "CpuTreeBatch":
        """An empty :class:`CpuTreeBatch` with ``params``' constants (their
        budget and seed are the members'; search_service/mcts/batch.py);
        sliced for rollouts where ``rollout_slice_ms`` is set."""
        sliced = params.evaluator == "rollout" and self.rollout_slice_ms
        return CpuTreeBatch(params, evaluator, self.rollout_slice_ms if sliced else None)

    @staticmethod
    def reroot(tree: tr.Tree, actions: list[int]) -> tr.Tree | None:
        """See :func:`search_service.mcts.tree.reroot`."""
        return tr.reroot(tree, actions)

    @staticmethod
    def reroot_to(tree: tr.Tree, position) -> tr.Tree | None:
        """See :func:`search_service.mcts.tree.reroot_to`."""
        return tr.reroot_to(tree, position)

    @staticmethod
    def serves(game) -> str | None:
        """None: the CPU reference searches every game (its rules in NumPy)."""
        return None


_ROW_FIELDS = {  # per-tree state of a CpuTreeBatch: name -> dtype (row b: tree b)
    "seed": np.uint64,  # its search's 64-bit Philox key
    "stream": np.int64,  # its Philox tree word: the tree's index within its own request
    "done": np.int64,  # simulations completed since it joined
    "model_simulations": np.int64,  # of those, the ones the value model valued
    "waves": np.int64,  # completed waves it took part in
    "reused": bool,  # a tree passed in is searched further
    "pool_exhausted": bool,
    "max_depth": np.int64,  # longest selection path since it joined
    "waiting": bool,  # a fresh PUCT root not yet valued: the next wave's model call brings its priors
    "use_model": bool,  # its leaves are valued by the model (False after an EvaluationFailed)
    "failure": object,  # why the model stopped valuing its leaves ("" while it does)
    "ms": (np.float64, 4),  # wall-clock ms of the waves it took part in: select, expand, evaluate, backup
}


class CpuTreeBatch:
    """B trees searched together with NumPy, joined and left between waves
    (search_service/mcts/batch.py's :class:`TreeBatch`; the module docstring
    has the algorithm). The trees share ``params``' constants (K =
    ``parallel_sims``, the evaluator, the exploration constants, the node
    limit); each has its own seed, budget and statistics.

    Not thread-safe: one thread (a ``search`` call, or the search service's
    wave loop) owns a batch.
    """

    def __init__(self, params: SearchParams, evaluator: LeafEvaluator | None = None, slice_ms: float | None = None):
        if params.evaluator == "value_model" and evaluator is None:
            raise ValueError("evaluator 'value_model' needs a leaf evaluator")
        self.p = params
        self.k_max = params.parallel_sims
        self.slice_ms = slice_ms  # sliced waves (search_service/mcts/plan.py), or None
        self.evaluator = evaluator
        self.puct = params.evaluator == "value_model"  # PUCT selection with priors
        self.game = params.game
        self.a = params.game.num_actions  # A, edges per node
        self.max_depth = params.game.max_moves  # edges on a selection path, at most
        self.tree = tr.gather([], 1, self.game)
        self.tree.evaluator = params.evaluator
        self.row = {name: np.zeros(0, dt) if not isinstance(dt, tuple) else np.zeros((0, dt[1]), dt[0])
                    for name, dt in _ROW_FIELDS.items()}
        self._views()

    def __len__(self) -> int:
        return self.tree.batch

    @property
    def b(self) -> int:
        return self.tree.batch

    @property
    def done(self) -> np.ndarray:
        return self.row["done"]

    def live(self) -> np.ndarray:
        return self.tree.node_terminal[:, 0] == tr.NOT_TERMINAL

    def ready(self) -> np.ndarray:
        return ~self.row["waiting"]

    def failed(self) -> np.ndarray:
        return self.row["failure"] != ""

    # -- joining and leaving -------------------------------------------------
    def join(self, roots, trees: list | None, seeds: list[int], streams: list[int]) -> None:
        p, game = self.p, self.game
        trees = check_call(roots, p, self.evaluator, trees)
        states = game.as_states(roots)
        n = states.shape[0]
        reused = np.zeros(n, bool)
        reused[list(kept_trees(states, trees, p.evaluator, game=game))] = True
        fresh = tr.split(tr.new_trees(states, 1, p.evaluator, game))
        joining = [trees[i] if reused[i] else fresh[i] for i in range(n)]
        # Pool size: room for one node per simulation (the most a search can add)
        # when that is known, else a start that grows; never past max_nodes.
        used = max([int(t.num_nodes[0]) for t in joining] + [int(self.tree.num_nodes.max(initial=1))])
        adds = p.simulations if p.simulations is not None else max(_INITIAL_CAPACITY, p.parallel_sims)
        capacity = max(used, min(p.max_nodes, used + adds), self.tree.capacity)
        first = self.b
        self.tree = tr.gather(tr.split(self.tree) + joining, capacity, game)
        self.tree.evaluator = p.evaluator
        added = {name: np.zeros((n, *self.row[name].shape[1:]), self.row[name].dtype) for name in _ROW_FIELDS}
        added["seed"][:] = np.asarray(seeds, np.uint64)
        added["stream"][:] = streams
        added["reused"][:] = reused
        added["use_model"][:] = self.puct
        added["failure"][:] = ""
        self.row = {name: np.concatenate([self.row[name], added[name]]) for name in _ROW_FIELDS}
        self._views()
        if self.puct:  # roots never evaluated wait for the next wave's model call
            self.row["waiting"][first:] = self.tree.node_visits[first:, 0] == 0

    def leave(self, rows: list[int], members: list) -> tuple[list[SearchResult], list[tr.Tree], np.ndarray]:
        index = np.asarray(rows, np.int64)
        results = self._results(index, [ended_by(m) for m in members])
        singles = tr.split(self.tree)
        trees = [tr.gather([singles[i]], int(singles[i].num_nodes[0])) for i in rows]
        for t in trees:
            t.evaluator = self.p.evaluator
        keep = np.ones(self.b, bool)
        keep[index] = False
        self._keep(keep)
        return results, trees, np.flatnonzero(keep)

    def _keep(self, keep: np.ndarray) -> None:
        """Keeps the rows ``keep`` (bool [B]) only; the pools shrink to a
        quarter where the trees left use less than that (a large tree that
        left does not size every later row)."""
        tree = tr.take(self.tree, keep)
        used = int(tree.num_nodes.max(initial=1))
        if 4 * used < tree.capacity and tree.capacity > _INITIAL_CAPACITY:
            tree = tr.gather(tr.split(tree), max(_INITIAL_CAPACITY, 2 * used), self.game)
        tree.evaluator = self.p.evaluator
        self.tree = tree
        self.row = {name: self.row[name][keep] for name in _ROW_FIELDS}
        self._views()

    # -- flat views over the batched pool (row = tree * capacity + slot) ----
    def _views(self) -> None:
        t, n, a = self.tree, self.tree.capacity, self.a
        self.cap = n
        self.children = t.children.reshape(-1, a)
        self.visits = t.edge_visits.reshape(-1, a)
        self.value = t.edge_value.reshape(-1, a)
        self.vloss = t.edge_vloss.reshape(-1, a)
        self.prior = t.prior.reshape(-1, a)
        self.node_visits = t.node_visits.reshape(-1)
        self.node_terminal = t.node_terminal.reshape(-1)
        self.node_state = t.node_state.reshape(-1, self.game.state_words)

    def _ensure_capacity(self, k: int) -> None:
        need = min(self.p.max_nodes, int(self.tree.num_nodes.max()) + k)
        if need > self.tree.capacity:
            self.tree = tr.grow(self.tree, min(self.p.max_nodes, max(need, 2 * self.tree.capacity)))
        self._views()

    # -- a wave -------------------------------------------------------------
    def wave(self, ks: np.ndarray) -> bool:
        """One wave of ``ks[b]`` simulations in tree b (int64 [B], 0: none;
        sliced: at most ``ks[b]``, by waves of K, for ``slice_ms``); False if
        the model could not value it: the trees that used the model undo it
        (they are as they were before it) and go on with rollouts, the trees
        on rollouts keep theirs."""
        if self.slice_ms is not None:
            return sliced_waves(self._wave, ks, self.k_max, self.live, self.slice_ms)
        return self._wave(ks)

    def _wave(self, ks: np.ndarray) -> bool:
        if not ks.any():  # roots waiting for their priors, and no simulation to value beside them
            return self._value_roots_alone() is None
        self._ensure_capacity(int(ks.max()))  # a pool that grows counts in its wave's time
        in_wave = ks > 0
        used_model = self.row["use_model"] & in_wave
        t = time.perf_counter()
        with nvtx.span("search.select"):
            walk = self._select(ks, self.done)
        t1 = time.perf_counter()
        before = self.tree.num_nodes.copy()
        with nvtx.span("search.expand"):
            leaf = self._expand(walk)
        t2 = time.perf_counter()
        with nvtx.span("search.evaluate"):
            values, failure, roots_valued = self._evaluate(walk, leaf)
        t3 = time.perf_counter()
        done = in_wave
        if failure is not None:  # the model's trees undo the wave; those on rollouts keep theirs
            failed = used_model[walk["tree_of"]]  # [W]: the selections of the model's trees
            self._undo(_columns(walk, failed), before, used_model)
            self._stop_using_model(used_model, failure)
            self.row["ms"][used_model, 2] += (t3 - t2) * 1e3
            done = in_wave & ~used_model
            walk, leaf, values = _columns(walk, ~failed), _columns(leaf, ~failed), values[~failed]
            used_model = np.zeros_like(used_model)
        if walk["depth"].size:
            with nvtx.span("search.backup"):
                self._backup(walk, leaf, values)
        t4 = time.perf_counter()
        self.row["ms"][done] += np.array([t1 - t, t2 - t1, t3 - t2, t4 - t3]) * 1e3
        self.row["done"] += np.where(done, ks, 0)
        self.row["model_simulations"] += np.where(used_model, ks, 0)
        self.row["waves"] += done
        return failure is None and roots_valued

    def _stop_using_model(self, rows: np.ndarray, exc: EvaluationFailed) -> None:
        """Trees ``rows`` (bool [B] or int [M]) value their leaves by rollouts from now on."""
        self.row["use_model"][rows] = False
        self.row["failure"][rows] = str(exc) or type(exc).__name__

    def _undo(self, walk: dict, num_nodes: np.ndarray, trees: np.ndarray) -> None:
        """Takes a selected and expanded wave back out of trees ``trees`` (bool
        [B]; ``walk``: their selections): releases its virtual losses and
        unlinks the nodes it added (slots past ``num_nodes``, reused by later
        waves). ``pool_exhausted`` stays as the wave left it (the pool did fill)."""
        _, edges = self._path_edges(walk)
        np.add.at(self.vloss.reshape(-1), edges, -1)
        tree = self.tree
        for b in np.flatnonzero(trees & (tree.num_nodes != num_nodes)):
            slots = np.arange(num_nodes[b], tree.num_nodes[b])
            parents = b * self.cap + tree.node_parent[b, slots].astype(np.int64)
            self.children[parents, tree.node_action[b, slots].astype(np.int64)] = tr.UNEXPANDED
        tree.num_nodes[trees] = num_nodes[trees]

    # -- 1. selection ------------------------------------------------------
    def _select(self, ks: np.ndarray, done: np.ndarray) -> dict:
        """Descends ``ks[b]`` selections per tree in lockstep by depth; returns
        their paths and, per selection, its simulation index in its tree."""
        b, cap = self.b, self.cap
        k = int(ks.max())
        w = int(ks.sum())
        tree_of = np.repeat(np.arange(b, dtype=np.int64), ks)
        first = np.cumsum(ks) - ks  # each tree's first selection
        in_tree = np.arange(w) - first[tree_of]  # the selection's rank in its tree's wave
        path_rows = np.zeros((self.max_depth, w), np.int64)
        path_acts = np.zeros((self.max_depth, w), np.int64)
        depth = np.zeros(w, np.int64)
        stop_child = np.full(w, -1, np.int64)  # row of the finished node a selection stopped at, else -1
        idx = np.arange(w)  # selections still descending, in simulation order
        rows = tree_of * cap  # their current node rows: the roots
        for d in range(self.max_depth):
            if d == 0:  # every selection of tree t stands on its root; the j-th chooses j-th
                trees = np.flatnonzero(ks)  # every live tree's root
                node_rows, size, rank = trees * cap, ks[trees], in_tree
                group = np.searchsorted(trees, tree_of)
            elif k == 1:  # one selection per tree: all on distinct nodes
                node_rows, group, size, rank = rows, np.arange(rows.size), np.ones(rows.size, np.int64), 0
            else:
                node_rows, group, size, rank = _groups(rows)
            acts = self._choose(node_rows, size)  # [R, U]
            chosen = acts[rank, group]
            path_rows[d, idx] = rows
            path_acts[d, idx] = chosen
            depth[idx] = d + 1
            child = self.children[rows, chosen]
            child_rows = tree_of[idx] * cap + np.maximum(child, 0)
            finished = (child >= 0) & (self.node_terminal[child_rows] != tr.NOT_TERMINAL)
            stop_child[idx[finished]] = child_rows[finished]
            go = (child >= 0) & ~finished
            idx, rows = idx[go], child_rows[go]
            if idx.size == 0:
                break
        return dict(k=k, tree_of=tree_of, sim=done[tree_of] + in_tree, rows=path_rows, acts=path_acts, depth=depth,
                    stop_child=stop_child)

    def _choose(self, node_rows: np.ndarray, size: np.ndarray) -> np.ndarray:
        """int64 [R, U]: the action the r-th selection standing on node
        ``node_rows[u]`` (distinct rows) picks, for r < ``size[u]`` (R = max size);
        adds their virtual losses to the tree.

        Virtual loss on these edges is zero on entry: only selections at this
        depth touch them, and they all go through here together. So the score
        of an edge holding j virtual losses, for the r-th selection, is
        ``Q[j] + scale[r] * g[j]``; both tables are built first, and the r loop
        only looks them up.
        """
        p, a_count = self.p, self.a
        u_count, r_count = node_rows.size, int(size.max())
        n = self.visits.take(node_rows, axis=0).astype(np.float64)[:, :, None]  # [U, A, 1]
        w = self.value.take(node_rows, axis=0).astype(np.float64)[:, :, None]
        illegal = self.children.take(node_rows, axis=0) == tr.ILLEGAL  # [U, A]
        j = np.arange(r_count, dtype=np.float64)  # virtual losses already on the edge
        parent = self.node_visits.take(node_rows).astype(np.float64)[:, None] + j  # [U, R]: N incl. virtual
        n_eff = n + j  # [U, A, R]
        q = (w - p.virtual_loss * j) / np.maximum(n_eff, 1.0)
        if self.puct:
            prior = self.prior.take(node_rows, axis=0).astype(np.float64)[:, :, None]
            g = (p.c_puct * prior) / (1.0 + n_eff)
            scale = np.sqrt(parent)
        else:
            g = 1.0 / np.sqrt(np.maximum(n_eff, 1.0))
            scale = p.c_uct * np.sqrt(np.log(np.maximum(parent, 1.0)))
            q[:, :, 0] = np.where(n[:, :, 0] == 0, np.inf, q[:, :, 0])  # unvisited edges first
        q[illegal] = -np.inf
        q, g = q.reshape(-1), g.reshape(-1)
        at = (np.arange(u_count)[:, None] * a_count + np.arange(a_count)) * r_count  # [U, A]: offset of j = 0
        held = np.zeros((u_count, a_count), np.int64)  # virtual losses added so far
        acts = np.empty((r_count, u_count), np.int64)
        cols = np.arange(u_count)
        for r in range(r_count):
            k = at + held
            a = np.argmax(q[k] + scale[:, r : r + 1] * g[k], axis=1)
            acts[r] = a
            held[cols, a] += size > r
        self.vloss[node_rows] += held.astype(np.int32)
        return acts

    def _child_codes(self, node_rows: np.ndarray) -> np.ndarray:
        """int8 [U, A]: the ``node_terminal`` code of each child of nodes
        ``node_rows`` (NOT_TERMINAL where there is no child)."""
        kids = self.children[node_rows]
        base = (node_rows // self.cap * self.cap)[:, None]
        return np.where(kids >= 0, self.node_terminal[base + np.maximum(kids, 0)], tr.NOT_TERMINAL).astype(np.int8)

    # -- 2. expansion ------------------------------------------------------
    def _expand(self, walk: dict) -> dict:
        """Adds one node per distinct edge where selections stopped before a
        missing child; returns each selection's leaf (row, position, status)."""
        cap, tree, a, game = self.cap, self.tree, self.a, self.game
        w = walk["depth"].size
        last = walk["depth"] - 1
        cols = np.arange(w)
        edge_rows = walk["rows"][last, cols]
        edge_acts = walk["acts"][last, cols]
        leaf_row = walk["stop_child"].copy()  # -1 for selections that stopped at a missing child
        new = np.flatnonzero(leaf_row < 0)
        leaf_state = self.node_state[np.maximum(leaf_row, 0)]  # a copy (fancy indexing)
        leaf_terminal = self.node_terminal[np.maximum(leaf_row, 0)].copy()
        edge_key = np.full(w, -1, np.int64)  # distinct-leaf id for the value model
        if new.size:
            keys = edge_rows[new] * a + edge_acts[new]
            if walk["k"] == 1:  # one selection per tree: distinct edges, already in tree order
                uniq, inverse = keys, np.arange(keys.size)
            else:
                uniq, inverse = np.unique(keys, return_inverse=True)
            u_rows, u_acts = uniq // a, uniq % a
            u_tree = u_rows // cap
            state = game.play(self.node_state[u_rows], u_acts)
            term = game.terminal_code(state)
            # Slots in key order (tree, parent slot, action); beyond max_nodes, no node.
            first_of_tree = np.searchsorted(u_tree, u_tree, side="left")
            slot = tree.num_nodes[u_tree].astype(np.int64) + (np.arange(uniq.size) - first_of_tree)
            fits = slot < self.p.max_nodes
            self.row["pool_exhausted"][u_tree[~fits]] = True
            f_rows = u_tree[fits] * cap + slot[fits]
            if f_rows.size:
                self.node_state[f_rows] = state[fits]
                self.node_terminal[f_rows] = term[fits]
                self.node_visits[f_rows] = 0
                tree.node_parent.reshape(-1)[f_rows] = u_rows[fits] - u_tree[fits] * cap
                tree.node_action.reshape(-1)[f_rows] = u_acts[fits]
                kids, prior = tr.edges(game.legal(state[fits]), term[fits])
                self.children[f_rows] = kids
                self.prior[f_rows] = prior
                self.visits[f_rows] = 0
                self.value[f_rows] = 0
                self.vloss[f_rows] = 0
                self.children[u_rows[fits], u_acts[fits]] = slot[fits]
                tree.num_nodes += np.bincount(u_tree[fits], minlength=self.b).astype(np.int32)
            u_leaf_row = np.where(fits, u_tree * cap + slot, -1)
            leaf_row[new] = u_leaf_row[inverse]
            leaf_state[new] = state[inverse]
            leaf_terminal[new] = term[inverse]
            edge_key[new] = inverse
        return dict(row=leaf_row, state=leaf_state, terminal=leaf_terminal, key=edge_key)

    # -- 3. evaluation -----------------------------------------------------
    def _evaluate(self, walk: dict, leaf: dict) -> tuple[np.ndarray, EvaluationFailed | None, bool]:
        """float32 [W]: each selection's leaf value for the leaf's side to move,
        the model's failure (None where it valued its leaves; its trees'
        values are then meaningless), and whether it valued the roots waiting
        for their priors (their own call where no leaf needs the model)."""
        values = tr.OUTCOME_VALUE[leaf["terminal"]]  # exact where the result is known, 0 elsewhere
        open_ = np.flatnonzero(leaf["terminal"] == tr.NOT_TERMINAL)
        if open_.size == 0:
            return values, None, self._value_roots_alone() is None
        tree_of = walk["tree_of"][open_]
        by_rollout = ~self.row["use_model"][tree_of]
        if by_rollout.any():
            roll = open_[by_rollout]
            t = tree_of[by_rollout]
            values[roll] = self.game.rollout_values(leaf["state"][roll], walk["sim"][roll], self.row["stream"][t],
                                                    self.row["seed"][t])
            open_ = open_[~by_rollout]
            if open_.size == 0:
                return values, None, self._value_roots_alone() is None
        # Value model: one call per wave, one row per distinct leaf (selections
        # that stopped at the same missing child share it), then the roots waiting.
        keys = leaf["key"][open_]
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        who = open_[first]
        try:
            v, priors = self._value_roots(leaf["state"][who], time.perf_counter())
        except EvaluationFailed as exc:
            return values, exc, False
        values[open_] = v[inverse]
        rows = leaf["row"][who]
        if priors is not None:
            has_node = rows >= 0
            self.prior[rows[has_node]] = priors[has_node]
        return values, None, True

    def _call_model(self, states: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Values float32 [M] and masked, renormalised priors float32 [M, A] (or
        None) of unfinished states uint64 [M, W]."""
        values, priors = self.evaluator(self.game.observation(states))
        return model_answer(values, priors, self.game.legal(states))

    def _value_roots_alone(self) -> EvaluationFailed | None:
        """The roots waiting for their priors, valued by a call of their own (a
        wave with no leaf for the model); the model's failure, or None."""
        if not self.row["waiting"].any():
            return None
        try:
            self._value_roots(np.zeros((0, self.game.state_words), np.uint64), time.perf_counter())
        except EvaluationFailed as exc:
            return exc
        return None

    def _value_roots(self, states: np.ndarray, t: float) -> tuple[np.ndarray, np.ndarray | None]:
        """One model call for the leaves ``states`` (uint64 [M, W]) and the roots
        waiting for their priors (which are valued, ready, after it): the
        leaves' values and priors (float32 [M], [M, A] or None). Where the call
        fails the roots keep uniform priors and go on with rollouts; the
        failure is raised for the leaves' sake. ``t``: the wave's evaluation
        start (perf_counter s), counted as the roots' evaluation time."""
        waiting = np.flatnonzero(self.row["waiting"])
        rows = waiting * self.cap
        m = len(states)

        def valued() -> None:
            self.node_visits[rows] = 1  # the root's own evaluation: sqrt(N) > 0 at the first choice
            self.row["waiting"][waiting] = False
            self.row["ms"][waiting, 2] += (time.perf_counter() - t) * 1e3

        try:
            values, priors = self._call_model(np.concatenate([states, self.node_state[rows]]))
        except EvaluationFailed as exc:
            self._stop_using_model(waiting, exc)  # uniform priors stay; rollouts value the leaves
            valued()
            raise
        if priors is not None:
            self.prior[rows] = priors[m:]
        valued()
        return values[:m], None if priors is None else priors[:m]

    # -- 4. backup ---------------------------------------------------------
    def _path_edges(self, walk: dict) -> tuple[np.ndarray, np.ndarray]:
        """(node rows, flat edge indices) on every selection's path, depth-major."""
        depth = walk["depth"]
        on_path = np.arange(int(depth.max()))[:, None] < depth[None, :]  # [D, W]
        rows = walk["rows"][: on_path.shape[0]][on_path]
        return rows, rows * self.a + walk["acts"][: on_path.shape[0]][on_path]

    def _backup(self, walk: dict, leaf: dict, values: np.ndarray) -> None:
        depth = walk["depth"]
        dmax = int(depth.max())
        on_path = np.arange(dmax)[:, None] < depth[None, :]  # [D, W]
        rows, edges = self._path_edges(walk)
        # The player choosing at depth d is the leaf's side to move iff depth - d is even.
        sign = 1 - 2 * ((depth[None, :] - np.arange(dmax)[:, None]) & 1)
        signed = (sign * values[None, :])[on_path].astype(np.float32)
        np.add.at(self.visits.reshape(-1), edges, 1)
        np.add.at(self.vloss.reshape(-1), edges, -1)
        np.add.at(self.value.reshape(-1), edges, signed)
        np.add.at(self.node_visits, rows, 1)
        leaf_rows = leaf["row"][leaf["row"] >= 0]
        np.add.at(self.node_visits, leaf_rows, 1)
        np.maximum.at(self.row["max_depth"], walk["tree_of"], depth)
        self._solve(walk)

    # -- 5. solve ----------------------------------------------------------
    def _solve(self, walk: dict) -> None:
        """Proves what the wave's results prove, deepest nodes first."""
        depth = walk["depth"]
        for d in range(int(depth.max()) - 1, -1, -1):
            rows = np.unique(walk["rows"][d, depth > d])
            rows = rows[self.node_terminal[rows] == tr.NOT_TERMINAL]
            if rows.size:
                self.node_terminal[rows] = tr.solve(self.children[rows], self._child_codes(rows))

    # -- answer --------------------------------------------------------------
    def _results(self, index: np.ndarray, ends: list[tuple[bool, bool]]) -> list[SearchResult]:
        """The results of trees ``index`` (int [M]); ``ends[i]``: (deadline_reached, stopped) of tree ``index[i]``."""
        t, row = self.tree, {name: values[index] for name, values in self.row.items()}
        visits = t.edge_visits[index, 0].astype(np.int64)  # [M, A]
        value = t.edge_value[index, 0].astype(np.float64)
        q = np.where(visits > 0, value / np.maximum(visits, 1), 0.0)
        root_value = value.sum(axis=1) / np.maximum(visits.sum(axis=1), 1)
        proven = t.node_terminal[index, 0]
        root_value = np.where(proven != tr.NOT_TERMINAL, tr.OUTCOME_VALUE[proven], root_value)
        roots = t.node_state[index, 0]
        action = best_action(visits, q, self.game.legal(roots), self._child_codes(index * self.cap),
                             t.prior[index, 0], self.game.loses_at_once(roots))
        pv = self._principal_variations(index)
        return [
            SearchResult(
                action=int(action[i]),
                visit_counts=visits[i],
                q_values=q[i].astype(np.float32),
                root_value=float(root_value[i]),
                principal_variation=pv[i],
                simulations=int(row["done"][i]),
                max_depth=int(row["max_depth"][i]),
                tree_nodes=int(t.num_nodes[b]),
                pool_exhausted=bool(row["pool_exhausted"][i]),
                deadline_reached=ends[i][0],
                select_ms=float(row["ms"][i, 0]),
                expand_ms=float(row["ms"][i, 1]),
                evaluate_ms=float(row["ms"][i, 2]),
                backup_ms=float(row["ms"][i, 3]),
                tree_reused=bool(row["reused"][i]),
                model_simulations=int(row["model_simulations"][i]),
                evaluation_failure=row["failure"][i],
                proven=int(proven[i]),
                extras={"waves": int(row["waves"][i]), "stopped": ends[i][1]},
            )
            for i, b in enumerate(index.tolist())
        ]

    def _principal_variations(self, index: np.ndarray) -> list[list[int]]:
        """The principal variation of each tree ``index[i]``: the most-visited path from its root."""
        cap = self.cap
        pv: list[list[int]] = [[] for _ in range(index.size)]
        live = np.arange(index.size)
        rows = index * cap
        for _ in range(self.max_depth):
            n = self.visits[rows].astype(np.int64)
            q = np.where(n > 0, self.value[rows] / np.maximum(n, 1), 0.0)
            a = best_action(n, q)
            ok = n[np.arange(live.size), a] > 0
            for i, act in zip(live[ok], a[ok]):
                pv[i].append(int(act))
            child = self.children[rows, a]
            go = ok & (child >= 0)
            live, rows = live[go], index[live[go]] * cap + child[go]
            if live.size == 0:
                break
        return pv


def _columns(d: dict, cols: np.ndarray) -> dict:
    """A wave's per-selection arrays (the last axis of each: W; the first of
    the leaves' ``state``, [W, state words]) restricted to ``cols`` (bool [W])."""
    return {k: (v[cols] if k == "state" else v[..., cols]) if isinstance(v, np.ndarray) else v for k, v in d.items()}


def _groups(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Selections grouped by the node they stand on.

    Returns (distinct rows [U], group of each entry [S], group sizes [U], rank
    of each entry [S]: how many earlier entries stand on the same row).
    """
    uniq, group, size = np.unique(rows, return_inverse=True, return_counts=True)
    if uniq.size == rows.size:
        return uniq, group, size, np.zeros(rows.size, np.int64)
    order = np.argsort(group, kind="stable")
    starts = np.cumsum(size) - size
    rank = np.empty(rows.size, np.int64)
    rank[order] = np.arange(rows.size) - starts[group[order]]
    return uniq, group, size, rank


"""CPU reference MCTS: budget, tree invariants, pool exhaustion, determinism,
agreement with a one-at-a-time reference, tree reuse, PUCT, and strength
against the bitbully solver on Pascal Pons' positions."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from search_service.games import connect4 as c4
from search_service.mcts import tree as tr
from search_service.mcts.backend import SearchParams
from search_service.mcts.cpu_reference import CpuReferenceBackend
from search_service.mcts.rollout import rollout_values

DATA = Path(__file__).resolve().parents[2] / "data" / "connect4" / "pons"
BACKEND = CpuReferenceBackend()


def search(moves: str | list[str], **kw):
    texts = [moves] if isinstance(moves, str) else moves
    roots = c4.stack([c4.parse_moves(t) for t in texts])
    evaluator = kw.pop("evaluator_fn", None)
    trees = kw.pop("trees", None)
    params = SearchParams(**{"simulations": None, "deadline_ms": None, **kw})
    return BACKEND.search(roots, params, evaluator, trees)


def toy_model(obs: np.ndarray):
    """A deterministic stand-in for a value model: values in (-1, 1), no priors."""
    weights = (np.arange(84).reshape(2, 6, 7) % 7 - 3).astype(np.float32)
    return np.tanh((obs * weights).sum(axis=(1, 2, 3)) / 20).astype(np.float32), None


def zero_model(obs: np.ndarray):
    return np.zeros(len(obs), np.float32), None


def check_invariants(tree: tr.Tree, max_nodes: int) -> None:
    """Structural invariants of single trees after a search."""
    assert tree.batch == 1
    n = int(tree.num_nodes[0])
    assert 1 <= n <= max(max_nodes, 1) and n <= tree.capacity
    kids = tree.children[0, :n]
    assert kids.max() < n and kids.min() >= tr.ILLEGAL
    assert not tree.edge_vloss[0, :n].any()  # virtual loss fully removed
    visits = tree.edge_visits[0, :n]
    assert (visits[kids == tr.ILLEGAL] == 0).all()
    assert (np.abs(tree.edge_value[0, :n]) <= visits + 1e-4).all()
    for node in range(1, n):  # each edge's visits are its child's visits
        parent, action = tree.node_parent[0, node], tree.node_action[0, node]
        assert kids[parent, action] == node
        assert visits[parent, action] == tree.node_visits[0, node]
    # Positions follow from the parent's by the edge's move.
    if n > 1:
        nodes = np.arange(1, n)
        par = tree.node_parent[0, nodes]
        moves = tree.node_action[0, nodes].astype(np.int64)
        cur, mask = c4.play_bits(tree.node_current[0, par], tree.node_mask[0, par], moves)
        assert (cur == tree.node_current[0, nodes]).all() and (mask == tree.node_mask[0, nodes]).all()


# -- budget and invariants -------------------------------------------------------


@pytest.mark.parametrize("k, sims", [(1, 60), (4, 60), (16, 37), (7, 100)])
def test_root_visits_sum_to_simulations(k, sims):
    results, trees = search(["", "4453", "1234567"], simulations=sims, parallel_sims=k, seed=3)
    for r, t in zip(results, trees):
        assert r.simulations == sims and int(r.visit_counts.sum()) == sims
        assert r.visit_counts.dtype == np.int64 and r.q_values.dtype == np.float32
        assert r.visit_counts.shape == r.q_values.shape == (7,)
        assert t.node_visits[0, 0] == sims  # the root itself (rollouts: no root evaluation)
        assert -1 <= r.root_value <= 1
        assert np.isclose(r.root_value, t.edge_value[0, 0].sum() / sims, atol=1e-6)
        assert r.action == r.principal_variation[0] and r.visit_counts[r.action] == r.visit_counts.max()
        check_invariants(t, 200_000)
        assert r.select_ms >= 0 and r.evaluate_ms > 0 and not r.deadline_reached


@pytest.mark.parametrize("evaluator", ["rollout", "value_model"])
def test_invariants_with_virtual_loss(evaluator):
    fn = toy_model if evaluator == "value_model" else None
    results, trees = search(["", "3344"], simulations=300, parallel_sims=8, evaluator=evaluator, evaluator_fn=fn)
    for text, r, t in zip(["", "3344"], results, trees):
        check_invariants(t, 200_000)
        assert r.max_depth >= 2 and r.tree_nodes == int(t.num_nodes[0])
        c4.parse_moves(text + c4.moves_to_text(r.principal_variation))  # the PV is a legal line


def test_principal_variation_follows_most_visited_edges():
    (r,), (t,) = search("4", simulations=400, parallel_sims=4)
    node = 0
    for a in r.principal_variation:
        row = t.edge_visits[0, node]
        assert row[a] == row.max() > 0
        node = t.children[0, node, a]
        if node < 0:
            break


@pytest.mark.parametrize("max_nodes", [1, 5, 40])
def test_pool_exhaustion_stops_expansion_without_overflow(max_nodes):
    results, trees = search(["", "44"], simulations=200, parallel_sims=4, max_nodes=max_nodes)
    for r, t in zip(results, trees):
        assert r.pool_exhausted and r.tree_nodes == max_nodes and r.simulations == 200
        assert int(r.visit_counts.sum()) == 200
        n = int(t.num_nodes[0])
        assert t.children[0, :n].max() < n
        assert not t.edge_vloss[0, :n].any()
    (r,), _ = search("", simulations=20, parallel_sims=4, max_nodes=10_000)
    assert not r.pool_exhausted


def test_pool_grows_lazily_up_to_max_nodes():
    _, (t,) = search("", simulations=20, parallel_sims=4)
    assert t.capacity == 21  # a simulation budget sizes the pool: one node per simulation at most
    (r,), (t2,) = search("", simulations=100, parallel_sims=4, trees=[t])
    assert r.tree_nodes > 101 and t2.capacity >= r.tree_nodes  # grew past the 101 slots it started with
    check_invariants(t2, 200_000)
    (r,), (t3,) = search("", simulations=100, parallel_sims=4, trees=[t], max_nodes=60)
    assert r.tree_nodes == 60 == t3.capacity and r.pool_exhausted
    check_invariants(t3, 60)


def test_reused_tree_larger_than_the_pool_limit():
    (r,), (t,) = search("4", simulations=300, parallel_sims=4)
    (r2,), (t2,) = search("4", simulations=40, parallel_sims=4, max_nodes=10, trees=[t])
    assert r2.tree_reused and r2.pool_exhausted and r2.tree_nodes == r.tree_nodes
    assert int(r2.visit_counts.sum()) == 340
    check_invariants(t2, r.tree_nodes)


def test_deadline_only_budget_stops():
    (r,), _ = search("", deadline_ms=1.0, parallel_sims=4)
    assert r.deadline_reached and r.simulations >= 4 and r.simulations % 4 == 0
    assert int(r.visit_counts.sum()) == r.simulations
    (r,), _ = search("", simulations=8, deadline_ms=60_000.0, parallel_sims=4)
    assert not r.deadline_reached and r.simulations == 8


def test_bad_requests_raise():
    with pytest.raises(ValueError, match="budget"):
        SearchParams(simulations=None, deadline_ms=None)
    with pytest.raises(ValueError, match="evaluator"):
        SearchParams(simulations=1, deadline_ms=None, evaluator="minimax")
    with pytest.raises(ValueError, match="parallel_sims"):
        SearchParams(simulations=1, deadline_ms=None, parallel_sims=0)
    with pytest.raises(ValueError, match="finished"):
        search("1212121", simulations=10)
    with pytest.raises(ValueError, match="leaf evaluator"):
        search("", simulations=10, evaluator="value_model")
    _, (t,) = search("4", simulations=10)
    with pytest.raises(ValueError, match="another position"):
        search("5", simulations=10, trees=[t])


# -- determinism and the one-at-a-time reference ---------------------------------------


@pytest.mark.parametrize("k", [1, 8])
def test_same_seed_same_search(k):
    a, ta = search(["", "4"], simulations=200, parallel_sims=k, seed=11)
    b, tb = search(["", "4"], simulations=200, parallel_sims=k, seed=11)
    c, _ = search(["", "4"], simulations=200, parallel_sims=k, seed=12)
    for x, y in zip(a, b):
        assert np.array_equal(x.visit_counts, y.visit_counts) and np.array_equal(x.q_values, y.q_values)
        assert x.principal_variation == y.principal_variation and x.tree_nodes == y.tree_nodes
    for x, y in zip(ta, tb):
        n = int(x.num_nodes[0])
        assert np.array_equal(x.edge_value[0, :n], y.edge_value[0, :n])
        assert np.array_equal(x.children[0, :n], y.children[0, :n])
    assert any(not np.array_equal(x.visit_counts, z.visit_counts) for x, z in zip(a, c))


class _RefNode:
    def __init__(self, current: int, mask: int):
        self.current, self.mask = np.uint64(current), np.uint64(mask)
        cur, msk = np.array([current], np.uint64), np.array([mask], np.uint64)
        self.terminal = int(tr.terminal_code(cur, msk)[0])
        kids, prior = tr.init_edges(msk, np.array([self.terminal], np.int8))
        self.illegal = kids[0] == tr.ILLEGAL
        self.prior = prior[0]
        self.n = np.zeros(7)
        self.w = np.zeros(7, np.float32)
        self.v = np.zeros(7)
        self.visits = 0
        self.kids: dict[int, _RefNode] = {}


def reference_search(moves: str, tree_index: int, p: SearchParams, model=None) -> _RefNode:
    """MCTS one selection at a time, in the simplest possible form, with the
    semantics the module docstring of cpu_reference states."""
    pos = c4.parse_moves(moves)
    root = _RefNode(int(pos.current[0]), int(pos.mask[0]))
    puct = p.evaluator == "value_model"

    def evaluate(node):
        if node.terminal:  # terminal or proven: the exact result
            return float(tr.OUTCOME_VALUE[node.terminal])
        v, _ = model(c4.observation(c4.Positions(np.array([node.current]), np.array([node.mask]), np.array([0]))))
        return float(np.float32(np.clip(v[0], -1, 1)))

    if puct:
        root.visits = 1

    def choose(node):
        n_eff = node.n + node.v
        parent = np.array([[node.visits + node.v.sum()]])
        q = (node.w.astype(np.float64) - p.virtual_loss * node.v) / np.maximum(n_eff, 1.0)
        if puct:
            score = q + np.sqrt(parent)[0] * ((p.c_puct * node.prior.astype(np.float64)) / (1.0 + n_eff))
        else:
            scale = (p.c_uct * np.sqrt(np.log(np.maximum(parent, 1.0))))[0]
            score = q + scale * (1.0 / np.sqrt(np.maximum(n_eff, 1.0)))
            score[n_eff == 0] = np.inf
        score[node.illegal] = -np.inf
        return int(np.argmax(score))

    def solve(node):
        """MCTS-Solver: a lost child proves a win; all children known, their best."""
        results = [-tr.OUTCOME_VALUE[node.kids[a].terminal] if a in node.kids and node.kids[a].terminal else None
                   for a in range(7) if not node.illegal[a]]
        if 1.0 in results:
            return tr.PROVEN_WIN
        if None in results:
            return tr.NOT_TERMINAL
        return {1.0: tr.PROVEN_WIN, 0.0: tr.PROVEN_DRAW, -1.0: tr.PROVEN_LOSS}[max(results)]

    done = 0
    while done < p.simulations and not root.terminal:
        k = min(p.parallel_sims, p.simulations - done)
        walks = []
        for _ in range(k):
            node, path = root, []
            while True:
                a = choose(node)
                node.v[a] += 1
                path.append((node, a))
                child = node.kids.get(a)
                if child is None or child.terminal:
                    walks.append((path, child))
                    break
                node = child
        leaves = []
        for path, child in walks:
            if child is None:  # add the node, once per edge
                node, a = path[-1]
                if a not in node.kids:
                    cur, msk = c4.play_bits(np.array([node.current]), np.array([node.mask]), np.array([a]))
                    node.kids[a] = _RefNode(int(cur[0]), int(msk[0]))
                child = node.kids[a]
            leaves.append(child)
        values = []
        for j, leaf in enumerate(leaves):
            if leaf.terminal or puct:
                values.append(evaluate(leaf))
            else:
                one = lambda x: np.array([x])  # noqa: E731
                v = rollout_values(one(leaf.current), one(leaf.mask), one(done + j), one(tree_index), p.seed)
                values.append(float(v[0]))
        for (path, _), leaf, v in zip(walks, leaves, values):
            for d, (node, a) in enumerate(path):
                sign = 1.0 if (len(path) - d) % 2 == 0 else -1.0
                node.n[a] += 1
                node.v[a] -= 1
                node.w[a] += np.float32(sign * v)
                node.visits += 1
            leaf.visits += 1
        for path, _ in walks:  # every path bottom-up: the proofs reach their fixpoint
            for node, _ in reversed(path):
                if not node.terminal:
                    node.terminal = solve(node)
        done += k
    return root


def _count(node: _RefNode) -> int:
    return 1 + sum(_count(c) for c in node.kids.values())


@pytest.mark.parametrize("k", [1, 3, 16])
@pytest.mark.parametrize("evaluator", ["rollout", "value_model"])
def test_matches_one_selection_at_a_time(k, evaluator):
    texts = ["", "4453"]
    model = toy_model if evaluator == "value_model" else None
    params = SearchParams(simulations=150, deadline_ms=None, parallel_sims=k, evaluator=evaluator, seed=5)
    results, trees = BACKEND.search(c4.stack([c4.parse_moves(t) for t in texts]), params, model)
    for i, (text, r, t) in enumerate(zip(texts, results, trees)):
        ref = reference_search(text, i, params, model)
        assert np.array_equal(r.visit_counts, ref.n.astype(np.int64))
        assert np.array_equal(t.edge_value[0, 0], ref.w)
        assert r.tree_nodes == _count(ref)


# -- tree reuse -----------------------------------------------------------------------


def test_reroot_keeps_the_child_and_search_continues():
    (r,), (t,) = search("44", simulations=600, parallel_sims=4, seed=2)
    a = r.action
    child = int(t.children[0, 0, a])
    b = int(np.argmax(t.edge_visits[0, child]))
    grandchild = int(t.children[0, child, b])
    assert grandchild > 0
    kept = t.edge_visits[0, grandchild].copy()
    kept_value = t.edge_value[0, grandchild].copy()
    rerooted = BACKEND.reroot(t, [a, b])
    assert rerooted is not None
    assert np.array_equal(rerooted.edge_visits[0, 0], kept) and np.array_equal(rerooted.edge_value[0, 0], kept_value)
    assert rerooted.node_visits[0, 0] == t.node_visits[0, grandchild]
    position = c4.parse_moves("44" + c4.moves_to_text([a, b]))
    assert c4.same_position(rerooted.root_positions(), position)
    check_invariants(rerooted, 200_000)
    assert t.edge_visits[0, 0].sum() == 600  # the input tree is untouched

    (r2,), (t2,) = search("44" + c4.moves_to_text([a, b]), simulations=100, parallel_sims=4, trees=[rerooted])
    assert r2.tree_reused
    assert int(r2.visit_counts.sum()) == int(kept.sum()) + 100
    check_invariants(t2, 200_000)

    assert BACKEND.reroot(t, []) is t
    missing = [x for x in range(7) if t.children[0, child, x] == tr.UNEXPANDED]
    if missing:
        assert BACKEND.reroot(t, [a, missing[0]]) is None
    found = tr.reroot_to(t, position)
    assert found is not None and np.array_equal(found.edge_visits[0, 0], kept)


def test_tree_of_another_evaluator_is_replaced():
    _, (t,) = search("4", simulations=50)
    (r,), _ = search("4", simulations=50, evaluator="value_model", evaluator_fn=zero_model, trees=[t])
    assert not r.tree_reused and int(r.visit_counts.sum()) == 50


# -- PUCT and the leaf evaluator ------------------------------------------------------


@pytest.mark.parametrize("k", [1, 8])
def test_puct_with_uninformed_model_finds_an_immediate_win(k):
    # "445566": the first player wins at once in column 3 or 7 (0-based 2 or 6).
    (r,), _ = search("445566", simulations=100, parallel_sims=k, evaluator="value_model", evaluator_fn=zero_model)
    assert r.action in (2, 6) and r.q_values[r.action] == 1.0


def test_rollouts_find_an_immediate_win():
    (r,), _ = search("445566", simulations=200, parallel_sims=4)
    assert r.action in (2, 6)


def test_priors_steer_puct_and_are_masked_to_legal_moves():
    calls = []

    def model(obs):
        calls.append(obs.shape)
        priors = np.zeros((len(obs), 7), np.float32)
        priors[:, 0] = 5.0  # unnormalised on purpose; column 0 is full below
        priors[:, 1] = 1.0
        return np.zeros(len(obs), np.float32), priors

    (r,), (t,) = search("111111", simulations=64, parallel_sims=8, evaluator="value_model", evaluator_fn=model)
    assert r.visit_counts[0] == 0 and r.action == 1
    assert np.isclose(t.prior[0, 0].sum(), 1.0) and t.prior[0, 0, 0] == 0
    # One call for the root, then one per wave with that wave's distinct leaves.
    assert len(calls) == 1 + 64 // 8 and calls[0] == (1, 2, 6, 7)
    assert all(shape[0] <= 8 and shape[1:] == (2, 6, 7) for shape in calls)


def test_one_model_call_per_wave_for_all_trees():
    calls = []

    def model(obs):
        calls.append(len(obs))
        return toy_model(obs)

    results, _ = search(["", "4", "44"], simulations=40, parallel_sims=4, evaluator="value_model", evaluator_fn=model)
    assert len(calls) == 1 + 10 and calls[0] == 3 and max(calls[1:]) <= 12
    assert all(int(r.visit_counts.sum()) == 40 for r in results)


# -- strength against the solver ----------------------------------------------------------


def forced_wins(sample: int) -> list[dict]:
    """Pons positions whose side to move can force a win within its next 3
    stones (it wins with its (22 - score)-th stone and has moves // 2 already)."""
    rows = []
    for name in ("Test_L3_R1", "Test_L2_R1"):
        with open(DATA / f"{name}.jsonl") as f:
            for line in f:
                row = json.loads(line)
                if row["score"] > 0 and 22 - row["score"] <= len(row["moves"]) // 2 + 3:
                    rows.append(row)
    random.Random(2024).shuffle(rows)
    return rows[:sample]


STRENGTH_SIMULATIONS = 400


def test_plays_a_winning_move_when_a_quick_forced_win_exists():
    from bitbully import BitBully, Board

    rows = forced_wins(200)
    assert len(rows) == 200
    roots = c4.stack([c4.parse_moves(row["moves"]) for row in rows])
    params = SearchParams(simulations=STRENGTH_SIMULATIONS, deadline_ms=None, parallel_sims=16, seed=1)
    results, _ = BACKEND.search(roots, params)
    solver = BitBully()
    good = 0
    for row, r in zip(rows, results):
        board = Board("".join(str(int(ch) - 1) for ch in row["moves"]))
        scores = solver.score_all_moves(board)  # 0-based column -> Pons score for the mover
        assert scores[r.action] == row["move_scores"][str(r.action + 1)]  # the labels agree with the oracle
        good += scores[r.action] > 0
    assert good / len(rows) >= 0.9, f"{good}/{len(rows)} winning moves"

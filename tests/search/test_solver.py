"""MCTS-Solver (Winands, Bjornsson & Saito 2008) in the CPU reference: terminal
results proven up the tree, a proven win at the root played at once (the
CUDA backend's twin is in test_cuda_mcts.py)."""
from __future__ import annotations

import numpy as np
import pytest
from test_cpu_mcts import check_invariants, search, toy_model

from bench.value_search_quality import MODEL, onnx_evaluator  # the bundled network, ONNX Runtime on the CPU
from search_service.games import connect4 as c4
from search_service.mcts import tree as tr
from search_service.mcts.backend import best_action


# "445566": the side to move has three in a row (columns 4-6 of the bottom row)
# and wins at once in column 3 or 7; "443322" is its mirror (wins in 1 or 5).
# Without the solver, the two winning edges split the visits and a later win
# (column 4) got the most (seen with the value model at 200 and 1000 simulations).
@pytest.mark.parametrize("moves, wins", [("445566", {2, 6}), ("443322", {0, 4})])
@pytest.mark.parametrize("simulations", [200, 1000])
def test_an_immediate_win_is_proven_and_played_at_once(moves, wins, simulations):
    results, trees = search(moves, simulations=simulations, parallel_sims=16, evaluator="value_model",
                            evaluator_fn=onnx_evaluator(MODEL, threads=1), seed=7)
    r = results[0]
    assert r.action in wins and r.proven == tr.PROVEN_WIN
    assert r.simulations < simulations  # stopped once the root was proven
    check_invariants(trees[0], max_nodes=1 << 20)


@pytest.mark.parametrize("evaluator", ["rollout", "value_model"])
def test_a_move_proven_lost_is_never_played(evaluator):
    """After a long search of '445', children proven won for the opponent
    (moves proven lost) may exist; none of them is the move played."""
    model = toy_model if evaluator == "value_model" else None
    results, trees = search("445", simulations=3000, parallel_sims=8, evaluator=evaluator, evaluator_fn=model, seed=4)
    t = trees[0]
    kids = t.children[0, 0]
    codes = np.where(kids >= 0, t.node_terminal[0, np.maximum(kids, 0)], tr.NOT_TERMINAL)
    assert results[0].action not in np.flatnonzero(codes == tr.PROVEN_WIN)
    check_invariants(t, max_nodes=1 << 20)


def test_solve_is_the_negamax_of_known_results():
    U, I = tr.UNEXPANDED, tr.ILLEGAL
    kids = np.array([[1, 2, I, I, I, I, I], [1, 2, I, I, I, I, I], [1, U, I, I, I, I, I], [1, 2, I, I, I, I, I]])
    N, W, L, D = tr.NOT_TERMINAL, tr.PROVEN_WIN, tr.TERMINAL_LOSS, tr.PROVEN_DRAW
    codes = np.array([[W, L, N, N, N, N, N],  # a lost child: a win
                      [W, D, N, N, N, N, N],  # all known, best a draw
                      [W, N, N, N, N, N, N],  # one child missing: unknown
                      [W, W, N, N, N, N, N]], np.int8)  # every child wins for the opponent: a loss
    assert tr.solve(kids, codes).tolist() == [tr.PROVEN_WIN, tr.PROVEN_DRAW, tr.NOT_TERMINAL, tr.PROVEN_LOSS]


def test_best_action_plays_the_proof():
    visits = np.array([[50, 3, 40, 0, 0, 0, 0]])
    q = np.zeros((1, 7))
    N, W, L = tr.NOT_TERMINAL, tr.PROVEN_WIN, tr.PROVEN_LOSS
    codes = np.array([[N, L, N, N, N, N, N]], np.int8)
    assert best_action(visits, q, None, codes)[0] == 1  # a proven win beats more visits
    codes = np.array([[W, N, N, N, N, N, N]], np.int8)
    assert best_action(visits, q, None, codes)[0] == 2  # never a move proven lost ...
    codes = np.array([[W, W, W, W, W, W, W]], np.int8)
    assert best_action(visits, q, None, codes)[0] == 0  # ... unless all are: then the most visited
    legal = c4.legal_bits(c4.parse_moves("").mask).reshape(1, 7)
    assert best_action(visits, q, legal, None)[0] == 0


def test_a_proven_tree_stops_while_the_others_of_its_batch_go_on():
    results, trees = search(["121212", "4453"], simulations=200, parallel_sims=8, evaluator="rollout", seed=3)
    won, open_ = results
    assert won.proven == tr.PROVEN_WIN and won.action == 0 and won.simulations < 200
    assert open_.simulations == 200 and int(open_.visit_counts.sum()) == 200
    for t in trees:
        check_invariants(t, max_nodes=1 << 20)

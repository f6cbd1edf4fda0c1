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


# -- a lost position resists as long as it can ----------------------------------------------------------


def _random_positions(n: int, seed: int) -> c4.Positions:
    rng = np.random.default_rng(seed)
    found = []
    while len(found) < n:
        p = c4.empty()
        for _ in range(int(rng.integers(0, 40))):
            legal = np.flatnonzero(c4.legal_mask(p)[0])
            if len(legal) == 0 or c4.is_terminal(p)[0]:
                break
            p = c4.play(p, rng.choice(legal))
        if not c4.is_terminal(p)[0]:
            found.append(p)
    return c4.stack(found)


def test_loses_at_once_is_a_legal_move_after_which_the_opponent_wins_with_its_next_stone():
    p = _random_positions(300, seed=11)
    got = c4.loses_at_once_bits(p.current, p.mask)
    for b in range(len(p)):
        one = c4.take(p, [b])
        for a in range(c4.NUM_ACTIONS):
            expected = False
            if c4.legal_mask(one)[0, a]:
                child = c4.play(one, a)
                expected = not c4.last_mover_won(child)[0] and bool(c4.winning_moves(child)[0].any())
            assert got[b, a] == expected, (c4.to_text(one), a)
    assert got.any() and not got.all()  # the sample holds both kinds


def test_best_action_in_a_lost_position_prefers_the_proven_loss_that_holds_to_an_unsearched_blunder():
    N, W = tr.NOT_TERMINAL, tr.PROVEN_WIN  # codes of the children: W = the opponent's proven win
    visits = np.array([[1, 1, 0, 1998, 0, 0, 0]])
    codes = np.array([[N, N, N, W, N, N, N]], np.int8)
    legal = np.array([[1, 1, 0, 1, 0, 0, 0]], bool)
    at_once = np.array([[1, 1, 0, 0, 0, 0, 0]], bool)
    assert best_action(visits, np.zeros((1, 7)), legal, codes) == 0  # without the rules: the unproven blunder
    assert best_action(visits, np.zeros((1, 7)), legal, codes, loses_at_once=at_once) == 3
    # A move that holds is still preferred to a proven loss, and a win to everything.
    codes2 = np.array([[N, N, N, W, N, N, tr.PROVEN_LOSS]], np.int8)
    legal2 = np.array([[1, 1, 1, 1, 0, 0, 1]], bool)
    assert best_action(visits, np.zeros((1, 7)), legal2, codes[:, :7], loses_at_once=at_once) == 2
    assert best_action(visits, np.zeros((1, 7)), legal2, codes2, loses_at_once=at_once) == 6


# A lost position (issue 40's report): columns 1 and 2 let the opponent win at once, column 4 is
# proven lost but holds longer; the value-model search gave columns 1 and 2 one visit each.
LOST = "44723653614611335573773455421566672712"


@pytest.mark.parametrize("evaluator", ["value_model", "rollout"])
def test_a_lost_position_plays_the_move_that_holds_longest(evaluator):
    fn = onnx_evaluator(MODEL, threads=1) if evaluator == "value_model" else None
    results, _ = search(LOST, simulations=2000, parallel_sims=16, evaluator=evaluator, evaluator_fn=fn, seed=7)
    root = c4.parse_moves(LOST)
    assert c4.loses_at_once_bits(root.current, root.mask)[0].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert results[0].action == 3

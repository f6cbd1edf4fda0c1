"""Anytime value-model search: a wave the model cannot value is undone, the
tree is kept, and the search goes on with rollouts or answers at its deadline
(CPU reference; the CUDA backend's twin is in test_cuda_mcts.py)."""
from __future__ import annotations

import time

import numpy as np
import pytest
from test_cpu_mcts import check_invariants, search, toy_model

from search_service.games import connect4 as c4
from search_service.mcts.backend import EvaluationFailed, SearchParams, best_action
from search_service.mcts.cpu_reference import CpuReferenceBackend


class FailingModel:
    """``toy_model`` for ``works`` calls, then EvaluationFailed on every call
    (after ``delay_s``: a reward service that answers too late)."""

    def __init__(self, works: int, delay_s: float = 0.0):
        self.works, self.delay_s, self.calls = works, delay_s, 0

    def __call__(self, obs):
        self.calls += 1
        if self.calls > self.works:
            time.sleep(self.delay_s)
            raise EvaluationFailed("reward service: DEADLINE_EXCEEDED")
        return toy_model(obs)


@pytest.mark.parametrize("k", [1, 4, 16])
def test_a_failed_wave_is_undone_and_the_search_goes_on_with_rollouts(k):
    # Calls: the fresh root, then one per wave; the 4th call (3rd wave) fails.
    model = FailingModel(works=3)
    results, trees = search("4453", simulations=6 * k, parallel_sims=k, evaluator="value_model",
                            evaluator_fn=model, seed=3)
    r = results[0]
    assert r.simulations == 6 * k and r.model_simulations == 2 * k
    assert "DEADLINE_EXCEEDED" in r.evaluation_failure and not r.deadline_reached
    assert int(r.visit_counts.sum()) == 6 * k  # nothing of the failed wave was backed up
    check_invariants(trees[0], max_nodes=1 << 20)  # virtual loss released, no dangling child
    assert trees[0].evaluator == "value_model"  # the tree is kept, and reusable
    assert model.calls == 4  # no model call after the failure


def test_the_undone_wave_leaves_the_tree_as_it_was_before_it():
    """Two good waves, then one that fails and a caller that stops the search
    right after it: the tree is exactly the tree of the two good waves."""
    _, good = search("4453", simulations=8, parallel_sims=4, evaluator="value_model", evaluator_fn=toy_model, seed=5)
    model = FailingModel(works=3)
    params = SearchParams(simulations=12, deadline_ms=None, parallel_sims=4, evaluator="value_model", seed=5)
    results, undone = CpuReferenceBackend().search(c4.stack([c4.parse_moves("4453")]), params, model, None,
                                                   should_stop=lambda: model.calls > model.works)
    assert results[0].simulations == 8 and results[0].evaluation_failure
    a, b = good[0], undone[0]
    n = int(a.num_nodes[0])
    assert int(b.num_nodes[0]) == n
    for name in ("children", "edge_visits", "edge_value", "edge_vloss", "prior", "node_visits", "node_current"):
        assert np.array_equal(getattr(a, name)[0, :n], getattr(b, name)[0, :n]), name


def test_a_wave_that_cannot_finish_by_the_deadline_ends_the_search_at_it():
    # The 3rd wave's call outlasts the 1 s deadline, then fails (as a reward service
    # bound by the deadline does). Generous times: the first calls take milliseconds.
    model = FailingModel(works=3, delay_s=1.2)
    results, trees = search("4453", deadline_ms=1000.0, parallel_sims=4, evaluator="value_model",
                            evaluator_fn=model, seed=1)
    r = results[0]
    # Answered right after the failed call, from the tree of the two good waves: no rollout wave.
    assert r.deadline_reached and r.simulations == r.model_simulations == 8
    assert model.calls == 4
    check_invariants(trees[0], max_nodes=1 << 20)


def test_a_failing_root_evaluation_searches_the_same_tree_with_rollouts():
    results, trees = search("4453", simulations=40, parallel_sims=8, evaluator="value_model",
                            evaluator_fn=FailingModel(works=0), seed=2)
    r = results[0]
    assert r.simulations == 40 and r.model_simulations == 0 and r.evaluation_failure
    assert trees[0].evaluator == "value_model"
    check_invariants(trees[0], max_nodes=1 << 20)


def test_best_action_is_legal_without_visits():
    legal = c4.legal_bits(c4.parse_moves("1111112222").mask).reshape(1, 7)  # column 1 full
    zeros = np.zeros((1, 7))
    assert best_action(zeros.astype(np.int64), zeros, legal)[0] == 1
    visits = np.array([[0, 3, 3, 0, 0, 0, 0]])
    q = np.array([[0.0, 0.1, 0.2, 0, 0, 0, 0]])
    assert best_action(visits, q)[0] == 2  # most visits, then higher Q


def test_without_visits_the_policy_decides_among_the_legal_moves():
    legal = c4.legal_bits(c4.parse_moves("1111112222").mask).reshape(1, 7)  # column 1 full
    priors = np.array([[0.9, 0.0, 0.05, 0.0, 0.05, 0.0, 0.0]], np.float32)  # most on the full column
    visits = np.zeros((2, 7), np.int64)
    visits[1, 3] = 1  # the second tree was searched: its visits decide, not its priors
    both = np.repeat(legal, 2, axis=0)
    assert best_action(visits, np.zeros((2, 7)), both, None, np.repeat(priors, 2, axis=0)).tolist() == [2, 3]


class PolicyFirst:
    """Values the root with a policy (priors on column 6, 0-based 5), then
    answers every wave after ``delay_s`` with EvaluationFailed: a reward
    service too slow for the first wave's deadline."""

    def __init__(self, delay_s: float):
        self.delay_s, self.calls = delay_s, 0

    def __call__(self, obs):
        self.calls += 1
        if self.calls > 1:
            time.sleep(self.delay_s)
            raise EvaluationFailed("reward service: DEADLINE_EXCEEDED")
        priors = np.full((len(obs), 7), 0.01, np.float32)
        priors[:, 5] = 0.94
        return toy_model(obs)[0], priors


def test_a_search_answered_before_its_first_wave_plays_its_policy():
    """The first wave cannot be valued by the deadline and is undone: no
    simulation at all, so the root's policy (its priors) picks the move, not
    the lowest legal column."""
    results, _ = search("4453", deadline_ms=100.0, parallel_sims=4, evaluator="value_model",
                        evaluator_fn=PolicyFirst(delay_s=0.2), seed=1)
    r = results[0]
    assert r.simulations == 0 and int(r.visit_counts.sum()) == 0 and r.deadline_reached
    assert r.action == 5


def test_a_model_answering_the_wrong_shape_is_a_failed_evaluation():
    """A model whose outputs do not fit the leaves is treated as failing: the
    search keeps its tree, goes on with rollouts and says why."""
    def bad(obs):
        return np.zeros(len(obs) + 1, np.float32), None

    results, trees = search("4453", simulations=40, parallel_sims=8, evaluator="value_model", evaluator_fn=bad, seed=2)
    r = results[0]
    assert r.simulations == 40 and r.model_simulations == 0
    assert "returned" in r.evaluation_failure and "values for" in r.evaluation_failure
    check_invariants(trees[0], max_nodes=1 << 20)

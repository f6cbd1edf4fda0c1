"""The CUDA backend's batch of trees (search_service/cuda/tree_batch.py)
against the CPU reference: rollout and value-model trees joining a ragged
batch at different waves, each equal to the same search alone on the CPU
(one warp per tree: the reference's order), rows moved into the holes of
those that left, the slab grown past its first rows, and a wave the model
fails undone only in the model's trees. Every test needs a GPU (marker
``gpu``)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from test_batch import SlowModel, run_ragged, same_result  # noqa: E402
from test_cpu_mcts import toy_model  # noqa: E402

from search_service.cuda import CudaBackend  # noqa: E402
from search_service.games import connect4 as c4  # noqa: E402
from search_service.mcts import tree as tr  # noqa: E402
from search_service.mcts.backend import SearchParams  # noqa: E402
from search_service.mcts.cpu_reference import CpuReferenceBackend  # noqa: E402
from search_service.mcts.plan import OPEN, Member  # noqa: E402

pytestmark = pytest.mark.gpu

CPU = CpuReferenceBackend()
FIELDS = ("node_current", "node_mask", "node_terminal", "node_visits", "node_parent", "node_action",
          "children", "edge_visits", "edge_value", "edge_vloss", "prior")


class OneWarpBackend(CudaBackend):
    """The CUDA backend with one warp per tree (G = 32) and its batch of trees."""

    def __init__(self, rollout_slice_ms=None):
        super().__init__(sims_per_warp=32, value_sims_per_warp=32, rollout_slice_ms=rollout_slice_ms)


GPU = OneWarpBackend()
SPECS = [("4453", 200, 11, 0), ("", 64, 12, 0), ("1234567", 150, 13, 2), ("4453", 90, 14, 5), ("33", 37, 15, 7),
         ("4", 120, 16, 7), ("5", 40, 17, 8), ("6", 64, 18, 8), ("7", 80, 19, 9), ("2", 30, 20, 9)]


def alone(moves: str, **kw):
    evaluator = kw.pop("evaluator_fn", None)
    results, trees = CPU.search(c4.parse_moves(moves), SearchParams(**{"simulations": None, "deadline_ms": None, **kw}),
                                evaluator)
    return results[0], trees[0]


@pytest.mark.parametrize("k", [1, 8, 16])
def test_rollout_trees_in_a_ragged_device_batch_equal_the_reference_alone(k):
    """Ten searches (more than the slab's first eight rows), joining at
    waves 0 to 9 and leaving as their caps end them."""
    together = run_ragged(SPECS, k, backend=GPU)
    for i, (moves, sims, seed, _) in enumerate(SPECS):
        r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=k)
        same_result(together[i][0], r)
        host = together[i][1].to_host()
        n = int(t.num_nodes[0])
        assert int(host.num_nodes[0]) == n
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(host, name)[0, :n], getattr(t, name)[0, :n], err_msg=name)


@pytest.mark.parametrize("slice_ms", [0.02, 50.0])
def test_capped_rollout_trees_in_a_sliced_device_batch_equal_the_reference_alone(slice_ms):
    """The kernel's clock stops a warp between its waves; the next launch goes on from there."""
    together = run_ragged(SPECS[:6], 16, backend=OneWarpBackend(rollout_slice_ms=slice_ms))
    for i, (moves, sims, seed, _) in enumerate(SPECS[:6]):
        r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=16)
        same_result(together[i][0], r)
        assert int(together[i][1].to_host().num_nodes[0]) == int(t.num_nodes[0])


def test_a_sliced_device_wave_runs_a_deadline_only_tree_past_k_and_a_capped_one_to_its_cap():
    batch = CudaBackend(rollout_slice_ms=2.0).open_batch(SearchParams(simulations=None, deadline_ms=1.0,
                                                                         parallel_sims=16))
    batch.join(c4.stack([c4.parse_moves(""), c4.parse_moves("4")]), [None, None], [1, 2], [0, 1])
    assert batch.wave(np.array([OPEN, 40]))
    assert batch.done[0] > 16 and batch.done[1] == 40


def test_value_model_trees_in_a_ragged_device_batch_match_the_reference_alone():
    """Up to float32 rounding of the value sums (the warp adds them in
    another order): the same visit counts and moves."""
    specs = SPECS[:6]
    together = run_ragged(specs, 8, "value_model", toy_model, backend=GPU)
    like_alone(specs, together, toy_model)


def like_alone(specs, together, model, priors: bool = False) -> None:
    """Each value-model search of ``specs`` run in a ragged batch (``together``,
    from run_ragged, K = 8) has the simulations, visit counts, Q-values and
    move of the same search run alone by the reference (and its root's priors)."""
    for i, (moves, sims, seed, _) in enumerate(specs):
        r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=8, evaluator="value_model",
                     evaluator_fn=model)
        g = together[i][0]
        assert g.simulations == r.simulations == g.model_simulations == sims
        np.testing.assert_array_equal(g.visit_counts, r.visit_counts)
        np.testing.assert_allclose(g.q_values, r.q_values, atol=1e-5)
        assert g.action == r.action
        if priors:
            np.testing.assert_allclose(together[i][1].to_host().prior[0, 0], t.prior[0, 0], atol=1e-6)


def policy_logits(obs):
    """float32 [M, 7]: per column, the side to move's stones less the opponent's (as uint8: -1 wraps to 255)."""
    return (obs[:, 0].sum(axis=1) - obs[:, 1].sum(axis=1)).astype(np.float32)


def policy_model(obs):
    """toy_model's values with priors that depend on the position (no service)."""
    values, _ = toy_model(obs)
    logits = policy_logits(obs)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return values, e / e.sum(axis=1, keepdims=True)


class StandInWaves:
    """A stand-in for search_service.evaluators.DeviceWaves, without a reward
    service: the selection writes the leaves into ``inputs`` on the device,
    ``evaluate`` values rows ``[0, rows)`` by policy_model's rules (on the
    host) and hands back device regions of values and policy logits, rows
    past them garbage. Unordered: the batch synchronises before the call."""

    ordered = False

    def __init__(self, max_rows: int = 1024):
        self.max_rows = max_rows
        self.inputs = cupy.empty((max_rows, 2, c4.ROWS, c4.COLUMNS), np.uint8)
        self.values = cupy.empty((max_rows, 1), np.float32)
        self.logits = cupy.empty((max_rows, c4.NUM_ACTIONS), np.float32)
        self.calls: list[int] = []

    def carries(self, rows: int) -> bool:
        return rows <= self.max_rows

    def inputs_written(self) -> None:
        pass

    def evaluate(self, rows: int):
        obs = self.inputs[:rows].get()
        self.calls.append(rows)
        self.values[:rows] = cupy.asarray(toy_model(obs)[0].reshape(rows, 1).astype(np.float32))
        self.logits[:rows] = cupy.asarray(policy_logits(obs))
        return self.values, self.logits


class DeviceWavesBackend(OneWarpBackend):
    """OneWarpBackend whose batches are lent one StandInWaves (``waves``) every wave."""

    def __init__(self):
        super().__init__()
        self.waves = StandInWaves()

    def open_batch(self, params, evaluator=None, lend=None):
        return super().open_batch(params, evaluator, lambda: contextlib.nullcontext(self.waves))


def test_value_model_trees_with_priors_and_short_last_waves_match_the_reference_alone():
    """Caps that are not multiples of K (a last wave of fewer simulations in
    some trees only: slots past their k hold no META row) and a policy head."""
    specs = [("4453", 45, 1, 0), ("", 13, 2, 0), ("3344", 61, 3, 1), ("7", 6, 4, 2)]
    together = run_ragged(specs, 8, "value_model", policy_model, backend=GPU)
    for i, (moves, sims, seed, _) in enumerate(specs):
        r, _ = alone(moves, simulations=sims, seed=seed, parallel_sims=8, evaluator="value_model",
                     evaluator_fn=policy_model)
        g = together[i][0]
        assert g.simulations == r.simulations == sims
        np.testing.assert_array_equal(g.visit_counts, r.visit_counts)
        assert g.action == r.action


def test_a_failed_wave_is_undone_only_in_the_models_trees_on_the_device():
    model = SlowModel(0.0, fail_after=0)
    params = SearchParams(simulations=None, deadline_ms=1.0, parallel_sims=4, evaluator="value_model")
    batch = GPU.open_batch(params, model)
    batch.join(c4.parse_moves("4"), [None], [1], [0])
    assert model.calls == 0 and batch.ready().tolist() == [False]  # its root waits for the next wave's call
    assert not batch.wave(np.array([0]))  # its root's evaluation fails: rollouts from now on
    assert batch.failed().tolist() == [True] and batch.ready().tolist() == [True]
    model.fail_after = None  # the next root is valued, beside the rollout tree's wave
    batch.join(c4.parse_moves("3"), [None], [2], [0])
    assert batch.wave(np.array([4, 0])) and batch.ready().all()
    model.fail_after = model.calls
    assert not batch.wave(np.array([4, 4]))
    assert batch.done.tolist() == [8, 0] and batch.failed().tolist() == [True, True]
    results, trees, kept = batch.leave([0, 1], [Member(None, None), Member(None, None)])
    assert [r.simulations for r in results] == [8, 0] and kept.size == 0
    host = trees[1].to_host()
    assert int(host.num_nodes[0]) == 1 and not host.edge_vloss.any() and not trees[0].to_host().edge_vloss.any()


def test_rows_that_stay_fill_the_holes_and_keep_their_trees():
    params = SearchParams(simulations=None, deadline_ms=1.0, parallel_sims=4)
    batch = GPU.open_batch(params)
    moves = ["", "1", "2", "3", "4"]
    batch.join(c4.stack([c4.parse_moves(m) for m in moves]), [None] * 5, [1, 2, 3, 4, 5], [0] * 5)
    for _ in range(3):
        batch.wave(np.full(len(batch), 4))
    before = batch.res.copy()
    results, _, kept = batch.leave([0, 2], [Member(None, None), Member(None, None)])
    assert kept.tolist() == [3, 1, 4] and len(batch) == 3  # rows 3 and 4 moved into rows 0 and 2
    assert [r.simulations for r in results] == [12, 12]
    batch._refresh()  # the RES rows of the moved device rows
    np.testing.assert_array_equal(batch.res["visits"], before["visits"][kept])
    batch.wave(np.full(3, 4))
    assert batch.done.tolist() == [16, 16, 16]
    assert (batch.res["outcome"][:, 0] == tr.NOT_TERMINAL).all()


def test_a_member_no_session_keeps_leaves_without_its_tree():
    params = SearchParams(simulations=None, deadline_ms=1.0, parallel_sims=4)
    batch = GPU.open_batch(params)
    batch.join(c4.stack([c4.parse_moves(m) for m in ["", "4"]]), [None] * 2, [1, 2], [0] * 2)
    batch.wave(np.full(2, 4))
    results, trees, kept = batch.leave([0, 1], [Member(None, None, keep_tree=False), Member(None, None)])
    assert [r.simulations for r in results] == [4, 4] and kept.size == 0
    assert trees[0] is None and int(trees[1].to_host().num_nodes[0]) == results[1].tree_nodes


def test_a_root_that_joins_gets_its_priors_from_the_next_waves_model_call():
    """No model call at the join; the next wave's one values the other
    tree's leaves and the new root together (host way), and the root's
    edges get the model's priors, as the CPU reference's do."""
    calls = []

    def counting(obs):
        calls.append(len(obs))
        return policy_model(obs)

    params = SearchParams(simulations=None, deadline_ms=1.0, parallel_sims=4, evaluator="value_model")
    batch, ref = GPU.open_batch(params, counting), CPU.open_batch(params, policy_model)
    for b in (batch, ref):
        b.join(c4.parse_moves("4"), [None], [1], [0])
        assert b.wave(np.array([0]))  # its root alone
        assert b.wave(np.array([4]))
        b.join(c4.parse_moves("334"), [None], [2], [0])  # the model's priors for it are not uniform
        assert b.ready().tolist() == [True, False]
        assert b.wave(np.array([4, 0])) and b.ready().all()
    assert len(calls) == 3 and calls[0] == 1  # the root alone, then two waves: the last one with the new root
    results, trees, _ = batch.leave([0, 1], [Member(None, None), Member(None, None)])
    expected, ref_trees, _ = ref.leave([0, 1], [Member(None, None), Member(None, None)])
    for got, want in zip(trees, ref_trees):
        np.testing.assert_allclose(got.to_host().prior[0, 0], want.prior[0, 0], atol=1e-6)
    assert [r.simulations for r in results] == [r.simulations for r in expected] == [8, 0]


def test_value_model_trees_by_device_waves_in_a_ragged_batch_match_the_reference_alone():
    """The device waves' way (tree_batch._device_wave): leaves in the lent
    input region, the backup reading the values and logits on the device
    (masked_priors), the roots that join while others search valued in the
    wave's call after its leaves' rows (init_trees' OBS rows,
    mcts_vm_root_priors): the same visit counts and moves as the reference."""
    specs = [("4453", 45, 1, 0), ("", 13, 2, 0), ("334", 61, 3, 1), ("7", 30, 4, 2), ("4", 20, 5, 2)]
    backend = DeviceWavesBackend()
    together = run_ragged(specs, 8, "value_model", policy_model, backend=backend)
    assert len(backend.waves.calls) > 5  # the waves went by the stand-in's regions
    like_alone(specs, together, policy_model, priors=True)


def test_roots_waiting_in_rows_apart_get_their_priors_from_one_device_wave():
    """Two roots join, a row leaves before the next wave and moves one of
    them into its hole: the waiting rows are 0 and 2, two runs of init_trees
    and mcts_vm_root_priors beside tree 1's leaves, one call; each root gets
    the priors the reference's batch gives it (its rows in another order)."""
    params = SearchParams(simulations=None, deadline_ms=1.0, parallel_sims=4, evaluator="value_model")
    backend = DeviceWavesBackend()
    batch, ref = backend.open_batch(params, policy_model), CPU.open_batch(params, policy_model)
    order = {}
    for b in (batch, ref):
        b.join(c4.stack([c4.parse_moves(m) for m in ("4453", "")]), [None] * 2, [1, 2], [0, 1])
        assert b.wave(np.zeros(2, np.int64)) and b.ready().all()  # their roots alone (host way)
        b.join(c4.stack([c4.parse_moves(m) for m in ("334", "7")]), [None] * 2, [3, 4], [0, 1])
        order[b] = b.leave([0], [Member(None, None)])[2]  # row r was row order[r] (joined r-th)
    assert order[batch].tolist() == [3, 1, 2] and batch.ready().tolist() == [False, True, False]
    calls = len(backend.waves.calls)
    for b in (batch, ref):
        assert b.wave(np.where(order[b] == 1, 4, 0)) and b.ready().all()  # the "" tree's wave
    assert backend.waves.calls[calls:] == [3 * 4 + 2]  # one call: the slots of the 3 rows, then both roots
    out = {}
    for b in (batch, ref):
        results, trees, _ = b.leave([0, 1, 2], [Member(None, None)] * 3)
        out[b] = {int(j): (r, t if b is ref else t.to_host()) for j, r, t in zip(order[b], results, trees)}
    for j in (1, 2, 3):
        (got, got_tree), (want, want_tree) = out[batch][j], out[ref][j]
        assert got.simulations == want.simulations == (4 if j == 1 else 0)
        np.testing.assert_array_equal(got.visit_counts, want.visit_counts)
        np.testing.assert_allclose(got_tree.prior[0, 0], want_tree.prior[0, 0], atol=1e-6)
    assert out[batch][2][1].prior[0, 0].max() > 0.5 and out[batch][3][1].prior[0, 0].max() > 0.5  # not uniform

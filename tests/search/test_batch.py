"""One batch of trees for every search in flight (CPU reference): the wave
plan's rules, a tree searched beside others equal to the same search alone
(rollouts and the shipped value model), ragged joins and leaves, and the
wave loop's admission, fairness and failures."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from search_service.games import connect4 as c4
from search_service.mcts import tree as tr
from search_service.mcts.backend import EvaluationFailed, SearchParams
from search_service.mcts.batch import step
from search_service.mcts.cpu_reference import CpuReferenceBackend
from search_service.mcts.plan import (END_BUDGET, END_DEADLINE, END_PROVEN, END_STOPPED, OPEN, Member, WaveTimes,
                                      plan_wave)
from search_service.wave_loop import Job, Refused, WaveLoop
from tandem.deadline import Deadline

BACKEND = CpuReferenceBackend()
MODEL = Path(__file__).resolve().parents[2] / "reward_service" / "models" / "connect4_value.onnx"
TREE_FIELDS = ("node_current", "node_mask", "node_terminal", "node_visits", "node_parent", "node_action",
               "children", "edge_visits", "edge_value", "edge_vloss", "prior")


def params(**kw) -> SearchParams:
    return SearchParams(**{"simulations": None, "deadline_ms": None, **kw})


def alone(moves: str, **kw):
    """The search run by itself: (result, tree)."""
    evaluator = kw.pop("evaluator_fn", None)
    results, trees = BACKEND.search(c4.parse_moves(moves), params(**kw), evaluator)
    return results[0], trees[0]


def same_tree(a: tr.Tree, b: tr.Tree) -> None:
    n = int(a.num_nodes[0])
    assert n == int(b.num_nodes[0])
    for name in TREE_FIELDS:
        np.testing.assert_array_equal(getattr(a, name)[0, :n], getattr(b, name)[0, :n], err_msg=name)


def same_result(a, b) -> None:
    assert (a.action, a.simulations, a.principal_variation, a.proven, a.model_simulations) == \
        (b.action, b.simulations, b.principal_variation, b.proven, b.model_simulations)
    np.testing.assert_array_equal(a.visit_counts, b.visit_counts)
    np.testing.assert_array_equal(a.q_values, b.q_values)


# -- the plan ------------------------------------------------------------------------


def test_the_plan_lets_proven_capped_late_and_stopped_members_leave():
    times = WaveTimes()
    times.add(64, 10.0)  # a wave of 64 simulations took 10 ms
    now = 100.0
    calls = []
    stop = lambda: calls.append(1) or True  # noqa: E731
    members = [
        Member(None, None),  # 0: runs on
        Member(None, None),  # 1: root proven
        Member(8, None),  # 2: cap reached
        Member(10, None),  # 3: 2 left of its cap
        Member(None, Deadline.after_s(0.005, now), tried=True),  # 4: 5 ms left, a wave takes >= 10
        Member(None, Deadline.after_s(0.005, now)),  # 5: the same, but it has had no wave yet: one always runs
        Member(None, None, stop, tried=True),  # 6 and 7: one stop check, asked once
        Member(None, None, stop, tried=True),
    ]
    done = np.array([0, 0, 8, 8, 0, 0, 0, 0])
    live = np.array([True, False, True, True, True, True, True, True])
    plan = plan_wave(members, done, live, times, 16, now=now)
    assert plan.leaving == [1, 2, 4, 6, 7]
    assert [members[i].end for i in plan.leaving] == [END_PROVEN, END_BUDGET, END_DEADLINE, END_STOPPED, END_STOPPED]
    assert plan.ks.tolist() == [16, 0, 0, 2, 0, 16, 0, 0] and len(calls) == 1


def test_deadline_only_members_share_a_wave_that_would_run_long_and_capped_ones_keep_k():
    times = WaveTimes()
    times.add(1, 0.0)  # no fixed cost
    for _ in range(3):
        times.add(32, 8.0)  # 0.25 ms a simulation: 4 trees at K 16 would take 16 ms
    members = [Member(None, None), Member(None, None), Member(None, None), Member(1000, None)]
    plan = plan_wave(members, np.zeros(4), np.ones(4, bool), times, 16, wave_target_ms=8.0, now=0.0)
    # 16 ms at K; the capped one's 16 take 4 ms of the 8: 16 leaves left for the other three, 5 each
    assert plan.ks.tolist() == [5, 5, 5, 16]
    assert plan_wave(members, np.zeros(4), np.ones(4, bool), times, 16, now=0.0).ks.tolist() == [16] * 4


def test_a_wave_whose_fixed_cost_is_most_of_it_is_not_cut_below_twice_that():
    """The model call's round trip (3 ms) is most of a wave: waves are cut to
    twice it (6 ms, 24 of K 32 each), not to the 4 ms target, where fewer
    simulations would save little time (the old proportional cut: 18)."""
    times = WaveTimes()
    times.add(32, 3.0 + 32 / 512)
    times.add(256, 3.5)
    times.add(256, 3.5)
    times.add(2048, 7.0)  # 3 ms fixed, 1/512 ms a leaf
    members = [Member(None, None) for _ in range(64)]
    plan = plan_wave(members, np.zeros(64), np.ones(64, bool), times, 32, wave_target_ms=4.0, now=0.0)
    assert plan.ks.tolist() == [24] * 64 and times.expected_ms(64 * 24) == pytest.approx(6.0)


def test_waves_that_cost_the_same_whatever_their_size_are_not_cut():
    times = WaveTimes()
    for _ in range(3):
        times.add(64, 9.0)  # one size seen: all of it fixed, no cost per leaf to save
    members = [Member(None, None) for _ in range(4)]
    plan = plan_wave(members, np.zeros(4), np.ones(4, bool), times, 16, wave_target_ms=4.0, now=0.0)
    assert plan.ks.tolist() == [16] * 4


def test_one_stall_among_the_recent_waves_is_forgiven_two_are_not():
    """A lone 25 ms stall (a first call of a new batch size, a collection)
    does not hold the next waves to 25 ms: members with 10 ms left would
    leave after one wave each. A second one among the recent waves counts."""
    times = WaveTimes()
    for _ in range(3):
        times.add(32, 1.5)
    times.add(32, 25.0)
    assert times.expected_ms(32) == pytest.approx(1.5)
    member = Member(None, Deadline.after_s(0.010, 100.0), tried=True)
    assert plan_wave([member], np.zeros(1), np.ones(1, bool), times, 32, now=100.0).leaving == []
    times.add(32, 25.0)
    assert times.expected_ms(32) == pytest.approx(25.0)
    assert plan_wave([member], np.zeros(1), np.ones(1, bool), times, 32, now=100.0).leaving == [0]


def test_wave_times_expect_a_fixed_cost_and_a_pessimistic_cost_per_simulation():
    times = WaveTimes(window=2, forgive=0)
    assert times.expected_ms(100) == 0.0
    times.add(1, 2.0)
    times.add(1, 2.0)
    assert times.expected_ms(2048) == 2.0  # one size seen: all of it taken as the fixed cost
    for _ in range(3):
        times.add(101, 5.0)  # 0.03 ms a simulation more than the 1-leaf waves' 2 ms
    assert times.expected_ms(101) == pytest.approx(5.0) and times.expected_ms(201) == pytest.approx(8.0)
    times.add(101, 4.0)
    assert times.expected_ms(101) == pytest.approx(5.0)  # the longest recent wave of a size
    times.add(101, 4.0)  # the 5 ms waves have left the window
    assert times.expected_ms(101) == pytest.approx(4.0)
    assert times.expected_ms(1) == pytest.approx(2.0)  # never under the quickest wave


def test_a_hiccup_in_a_small_wave_is_not_read_as_a_cost_per_leaf():
    """A 1 ms stall in a wave of 4 leaves: the old rule (the largest recent
    (ms - overhead) / leaves) expected a wave of 256 to take 64.5 ms, and the
    fair share cut every tree to one simulation a wave."""
    times = WaveTimes()
    for _ in range(3):
        times.add(4, 0.5 + 4 / 256)  # small waves: 0.5 ms fixed, 1/256 ms a leaf
    times.add(256, 1.5)
    times.add(256, 1.5)
    times.add(4, 1.5)  # 1 ms of it a stall
    assert times.line()[1] == pytest.approx(1 / 256)
    assert times.expected_ms(256) == pytest.approx(1.5)  # one stall among four waves: forgiven
    times.add(4, 1.5)
    assert times.line()[1] == pytest.approx(1 / 256)  # the small waves' median: still the unstalled ones
    assert times.expected_ms(256) == pytest.approx(1.5 + 252 / 256)  # two: the stalled wave, moved by 1/256 ms a leaf
    assert times.expected_ms(4) == pytest.approx(1.5)


def test_a_sliced_plan_opens_deadline_only_members_and_gives_capped_ones_their_rest():
    """Sliced waves (rollouts): no fair share, the slice ends the wave."""
    times = WaveTimes(sliced=True)
    times.add(4096, 1.2)  # a slice of any size: the longest recent one is what the next is expected to take
    times.add(64, 1.5)
    members = [Member(None, None), Member(1000, None), Member(None, Deadline(100.001), tried=True),
               Member(None, Deadline(100.1), tried=True)]
    plan = plan_wave(members, np.array([0, 990, 0, 0]), np.ones(4, bool), times, 16, wave_target_ms=0.1, now=100.0,
                     sliced=True)
    assert plan.ks.tolist() == [OPEN, 10, 0, OPEN] and plan.leaving == [2]  # 1 ms left < a 1.5 ms slice
    # the longest recent slice (none of them a stall), whatever the simulations
    assert times.expected_ms(1) == times.expected_ms(10**6) == pytest.approx(1.5)
    times.add(64, 4.0)  # a stall: more than 1.5 times the next longest, forgiven
    assert times.expected_ms(1) == pytest.approx(1.5)


# -- independence: a tree beside others equals it alone --------------------------------


def run_ragged(specs, k: int, evaluator="rollout", evaluator_fn=None, backend=BACKEND):
    """Searches ``specs`` ((moves, simulations, seed, join_at_wave)) in one
    batch of ``backend``'s, each joining at its wave; returns {index: (result,
    tree)} once all left."""
    batch = backend.open_batch(params(deadline_ms=1.0, parallel_sims=k, evaluator=evaluator), evaluator_fn)
    members: list[Member] = []
    out, times, wave = {}, WaveTimes(), 0
    while len(out) < len(specs):
        for i, (moves, sims, seed, at) in enumerate(specs):
            if at == wave:
                batch.join(c4.parse_moves(moves), [None], [seed], [0])
                members.append(Member(sims, None, owner=i))
        for m, r, t in step(batch, members, times):
            out[m.owner] = (r, t)
        wave += 1
    return out


@pytest.mark.parametrize("k", [1, 4, 16])
def test_rollout_trees_in_a_ragged_batch_equal_the_same_searches_alone(k):
    specs = [("4453", 200, 11, 0), ("", 64, 12, 0), ("1234567", 150, 13, 2), ("4453", 90, 14, 5), ("33", 37, 15, 7)]
    together = run_ragged(specs, k)
    for i, (moves, sims, seed, _) in enumerate(specs):
        r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=k)
        same_result(together[i][0], r)
        same_tree(together[i][1], t)
        assert together[i][0].simulations == sims


@pytest.mark.parametrize("k", [1, 16])
def test_capped_rollout_trees_in_a_sliced_ragged_batch_equal_the_same_searches_alone(k):
    """A slice stops a capped tree between waves of K, whatever it is."""
    specs = [("4453", 200, 11, 0), ("", 64, 12, 0), ("1234567", 150, 13, 2), ("33", 37, 15, 3)]
    for slice_ms in (0.05, 50.0):
        together = run_ragged(specs, k, backend=CpuReferenceBackend(rollout_slice_ms=slice_ms))
        for i, (moves, sims, seed, _) in enumerate(specs):
            r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=k)
            same_result(together[i][0], r)
            same_tree(together[i][1], t)


def test_a_sliced_wave_runs_waves_of_k_until_its_slice_or_cap_and_the_loop_answers_by_the_deadline():
    backend = CpuReferenceBackend(rollout_slice_ms=20.0)
    assert backend.open_batch(params(deadline_ms=1.0, evaluator="value_model"), lambda o: None).slice_ms is None
    batch = backend.open_batch(params(deadline_ms=1.0, parallel_sims=4))
    batch.join(c4.stack([c4.parse_moves(""), c4.parse_moves("4")]), [None, None], [1, 2], [0, 1])
    started = time.perf_counter()
    batch.wave(np.array([OPEN, 6]))
    assert batch.done[0] > 4 and batch.done[1] == 6  # several waves of K in the slice; the cap stops the other
    assert time.perf_counter() - started >= 0.020
    loop = WaveLoop(backend)
    try:
        j = job("", deadline_ms=150, parallel_sims=4, seed=3)
        loop.submit([j])
        assert j.done.wait(30) and j.error is None and j.result.deadline_reached and j.result.simulations > 4
    finally:
        loop.close()


class OnnxValueModel:
    """The shipped value model, run by ONNX Runtime on the CPU (no service)."""

    def __init__(self):
        self.session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]

    def __call__(self, obs):
        value, logits = self.session.run(None, {self.inputs[0]: np.ascontiguousarray(obs, np.uint8)})
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return value.reshape(-1), e / e.sum(axis=1, keepdims=True)


def test_value_model_trees_in_a_ragged_batch_equal_the_same_searches_alone():
    model = OnnxValueModel()
    specs = [("4453", 96, 1, 0), ("", 64, 2, 0), ("3344", 128, 3, 1), ("7", 40, 4, 3)]
    together = run_ragged(specs, 8, "value_model", model)
    for i, (moves, sims, seed, _) in enumerate(specs):
        r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=8, evaluator="value_model",
                     evaluator_fn=model)
        assert r.model_simulations == sims
        same_result(together[i][0], r)
        same_tree(together[i][1], t)


def test_a_session_tree_joins_a_batch_and_continues_as_it_would_alone():
    first, tree = alone("44", simulations=120, seed=5, parallel_sims=4)
    kept = tr.reroot(tree, [3, 3])  # the moves "44" and "44" played: rooted at "4444"
    assert kept is not None
    results, trees = BACKEND.search(c4.parse_moves("4444"), params(simulations=80, seed=6, parallel_sims=4), None,
                                    [kept])
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=4))
    batch.join(c4.parse_moves("1"), [None], [9], [0])  # another search, already under way
    members = [Member(300, None)]
    times = WaveTimes()
    step(batch, members, times)
    batch.join(c4.parse_moves("4444"), [kept], [6], [0])
    members.append(Member(80, None, owner="session"))
    left = []
    while members:
        left += step(batch, members, times)
    (r, t), = [(r, t) for m, r, t in left if m.owner == "session"]
    assert r.tree_reused and results[0].tree_reused
    same_result(r, results[0])
    same_tree(t, trees[0])


# -- the wave loop ---------------------------------------------------------------------


def job(moves: str, **kw) -> Job:
    return Job(c4.parse_moves(moves), None, params(**kw))


def test_searches_submitted_from_many_threads_are_answered_as_alone():
    loop = WaveLoop(BACKEND)
    try:
        jobs = [job("4453", simulations=50 + 10 * i, seed=100 + i, parallel_sims=4) for i in range(8)]
        threads = [threading.Thread(target=loop.submit, args=([j],)) for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, j in enumerate(jobs):
            assert j.done.wait(60) and j.error is None
            r, _ = alone("4453", simulations=50 + 10 * i, seed=100 + i, parallel_sims=4)
            same_result(j.result, r)
        assert loop.in_flight() == 0
    finally:
        loop.close()


def test_a_full_loop_refuses_at_once_and_keeps_serving():
    loop = WaveLoop(BACKEND, max_trees=2)
    try:
        with pytest.raises(Refused, match="max_trees"):
            loop.submit([job("", simulations=10), job("1", simulations=10), job("2", simulations=10)])
        ok = [job("", simulations=10, seed=1), job("1", simulations=10, seed=2)]
        loop.submit(ok)
        assert all(j.done.wait(30) and j.error is None and j.result.simulations == 10 for j in ok)
    finally:
        loop.close()


class SlowModel:
    """Values every leaf 0 after ``delay_s`` (a slow reward service)."""

    def __init__(self, delay_s: float, fail_after: int | None = None, error=EvaluationFailed):
        self.delay_s, self.fail_after, self.error, self.calls = delay_s, fail_after, error, 0

    def __call__(self, obs):
        self.calls += 1
        time.sleep(self.delay_s)
        if self.fail_after is not None and self.calls > self.fail_after:
            raise self.error("the model broke")
        return np.zeros(len(obs), np.float32), None


def wait_for_a_wave(loop: WaveLoop) -> None:
    lane = next(iter(loop._groups.values()))
    deadline = time.monotonic() + 30
    while lane.times.expected_ms(1) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_deadline_shorter_than_the_next_wave_is_refused_at_once_when_the_loop_is_busy():
    loop = WaveLoop(BACKEND, SlowModel(0.05))
    try:
        busy = job("", deadline_ms=3000, parallel_sims=4, evaluator="value_model")
        loop.submit([busy])
        wait_for_a_wave(loop)  # waves take >= 50 ms now
        began = time.perf_counter()
        with pytest.raises(Refused, match="expected to take"):
            loop.submit([job("4", deadline_ms=10, parallel_sims=4, evaluator="value_model")])
        assert time.perf_counter() - began < 0.05  # answered at once, not at its deadline
        late = job("4", deadline_ms=1000, parallel_sims=4, evaluator="value_model")
        loop.submit([late])  # time enough for a wave: admitted
        assert late.done.wait(30) and late.error is None and late.result.simulations > 0
        assert busy.done.wait(30) and busy.result.deadline_reached
    finally:
        loop.close()


def test_every_search_answers_by_its_deadline_while_others_join_and_leave():
    """Deadlines of 40 to 200 ms over waves of about 10 ms: each answers with
    the simulations it had, none after its deadline by more than one wave's
    scheduling slack, the late joiners included."""
    loop = WaveLoop(BACKEND, SlowModel(0.01))
    try:
        jobs = []
        for i, ms in enumerate([200, 40, 120, 80, 160, 60]):
            jobs.append(job("4453", deadline_ms=ms, parallel_sims=4, evaluator="value_model", seed=i + 1))
            loop.submit([jobs[-1]])
            time.sleep(0.015)
        for j in jobs:
            assert j.done.wait(30) and j.error is None
            assert j.result.deadline_reached and j.result.simulations > 0
    finally:
        loop.close()


def test_a_search_that_is_done_is_answered_before_a_newcomer_joins():
    """A join and the newcomer's first wave cost time (here its root valued
    by the next wave's model call): the search whose cap the last wave
    reached does not wait for them."""
    first = job("4453", simulations=4, parallel_sims=4, evaluator="value_model", seed=1)
    in_wave, go, seen = threading.Event(), threading.Event(), []

    def model(obs):
        call = len(seen) + 1
        seen.append(first.done.is_set())
        if call == 2:  # the first search's only wave: the newcomer is submitted meanwhile
            in_wave.set()
            assert go.wait(30)
        return np.zeros(len(obs), np.float32), None

    loop = WaveLoop(BACKEND, model)
    try:
        loop.submit([first])
        assert in_wave.wait(30)
        newcomer = job("3", simulations=4, parallel_sims=4, evaluator="value_model", seed=2)
        loop.submit([newcomer])
        go.set()
        assert first.done.wait(30) and newcomer.done.wait(30) and first.error is None and newcomer.error is None
        assert seen[:3] == [False, False, True]  # call 3, the newcomer's root: the first search already answered
    finally:
        loop.close()


def test_a_model_failure_sends_the_batch_on_with_rollouts_and_a_broken_batch_fails_only_its_searches():
    loop = WaveLoop(BACKEND, SlowModel(0.0, fail_after=3))
    try:
        a = job("", simulations=40, parallel_sims=4, evaluator="value_model", seed=1)
        loop.submit([a])
        assert a.done.wait(30) and a.error is None
        assert a.result.simulations == 40 and 0 < a.result.model_simulations < 40
        assert "the model broke" in a.result.evaluation_failure
    finally:
        loop.close()
    loop = WaveLoop(BACKEND, SlowModel(0.0, fail_after=2, error=RuntimeError))
    try:
        broken = job("", simulations=400, parallel_sims=4, evaluator="value_model", seed=1)
        loop.submit([broken])
        assert broken.done.wait(30) and isinstance(broken.error, RuntimeError)
        fine = job("", simulations=20, parallel_sims=4, seed=2)  # a rollout search: another lane, unharmed
        loop.submit([fine])
        assert fine.done.wait(30) and fine.error is None and fine.result.simulations == 20
        assert loop.in_flight() == 0
    finally:
        loop.close()


def test_a_search_that_leaves_is_answered_before_the_next_wave_runs():
    """Waves of 0.2 s: the capped search's answer is set while the next
    wave's model call (for the other search) is still under way."""
    model = SlowModel(0.2)
    calls_at_answer = []
    loop = WaveLoop(BACKEND, model)
    try:
        long = job("", deadline_ms=5000, parallel_sims=4, evaluator="value_model", seed=1)
        short = job("4", simulations=4, parallel_sims=4, evaluator="value_model", seed=2)
        loop.submit([long, short])
        assert short.done.wait(30) and short.error is None and short.result.simulations == 4
        calls_at_answer.append(model.calls)  # root evaluation + one wave: 2 calls; the next wave's is the 3rd
        assert calls_at_answer[0] <= 3
        time.sleep(0.05)
        assert not long.done.is_set()
    finally:
        loop.close()
    assert isinstance(long.error, Exception)  # answered (Stopping) when the loop closed


def test_a_wave_that_fails_does_not_lose_the_searches_that_left_before_it():
    loop = WaveLoop(BACKEND, SlowModel(0.0, fail_after=3, error=RuntimeError))
    try:
        # Calls: the two roots (one call), wave 1, wave 2 (the capped search's last), wave 3 raises.
        capped = job("4", simulations=8, parallel_sims=4, evaluator="value_model", seed=1)
        other = job("", simulations=400, parallel_sims=4, evaluator="value_model", seed=2)
        loop.submit([capped, other])
        assert capped.done.wait(30) and other.done.wait(30)
        assert capped.error is None and capped.result.simulations == 8
        assert isinstance(other.error, RuntimeError) and loop.in_flight() == 0
    finally:
        loop.close()


def test_trees_on_rollouts_keep_a_wave_the_model_failed_for_others():
    model = SlowModel(0.0, fail_after=0)  # every call fails
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=4, evaluator="value_model"), model)
    batch.join(c4.parse_moves("4"), [None], [1], [0])
    assert batch.ready().tolist() == [False]  # its root waits for the next wave's model call
    assert not batch.wave(np.array([0]))  # its root's evaluation fails: rollouts from now on
    assert batch.failed().tolist() == [True] and batch.ready().tolist() == [True]
    model.fail_after = None  # the next root is valued, beside the rollout tree's wave
    batch.join(c4.parse_moves("3"), [None], [2], [0])
    assert batch.wave(np.array([4, 0])) and batch.ready().tolist() == [True, True]
    model.fail_after = model.calls  # and every wave's call fails
    assert not batch.wave(np.array([4, 4]))
    assert batch.done.tolist() == [8, 0]  # the rollout tree kept its wave, the model's tree undid it
    assert batch.failed().tolist() == [True, True]
    results, trees, kept = batch.leave([0, 1], [Member(None, None), Member(None, None)])
    assert kept.size == 0
    assert [r.simulations for r in results] == [8, 0] and int(trees[1].num_nodes[0]) == 1
    assert not trees[1].edge_vloss.any() and not trees[0].edge_vloss.any()


def test_a_join_calls_no_model_and_the_next_wave_values_its_root_with_the_leaves():
    model = SlowModel(0.0)
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=4, evaluator="value_model"), model)
    batch.join(c4.parse_moves("4"), [None], [1], [0])
    assert model.calls == 0 and batch.ready().tolist() == [False]
    assert batch.wave(np.array([0])) and model.calls == 1  # its root alone: no leaf to go with it
    batch.join(c4.parse_moves("3"), [None], [2], [0])
    assert batch.wave(np.array([4, 0])) and model.calls == 2  # the first tree's leaves and the new root: one call
    assert batch.ready().all() and batch.done.tolist() == [4, 0]
    model.fail_after, model.error = model.calls, RuntimeError  # not an EvaluationFailed: the wave raises it
    batch.join(c4.parse_moves("5"), [None], [3], [0])
    with pytest.raises(RuntimeError):
        batch.wave(np.array([0, 0, 0]))


def test_the_pools_shrink_once_a_large_tree_has_left():
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=16))
    batch.join(c4.stack([c4.parse_moves(""), c4.parse_moves("4")]), [None, None], [1, 2], [0, 1])
    members, times, grown = [Member(20_000, None), Member(16, None)], WaveTimes(), 0
    while members:
        step(batch, members, times)
        grown = max(grown, batch.tree.capacity)
    assert grown > 20_000 and len(batch) == 0
    batch.join(c4.parse_moves("1"), [None], [3], [0])
    assert batch.tree.capacity <= 8192


# -- the estimator against stalls and mixed budgets (a reviewer's cases) -----------------------

def _true_ms(n: int) -> float:  # a batch's real cost: 5 ms a wave + 0.02 ms a leaf
    return 5.0 + 0.02 * n


def test_the_first_wave_of_a_grown_batch_sets_the_cost_per_leaf_so_the_next_is_not_expected_short():
    """30 waves of a lone search (16 leaves, 2 ms), then 32 searches' first
    wave of 512 leaves in 20 ms: the next such wave is expected to take about
    as long (an estimate from the small waves, ~2 ms, would keep members with
    10 ms left and answer them 10 ms late)."""
    times = WaveTimes()
    for _ in range(30):
        times.add(16, 2.0)
    times.add(512, 20.0)
    assert times.expected_ms(512) >= 19.0
    members = [Member(None, Deadline.after_s(0.010, 100.0), tried=True) for _ in range(32)]
    plan = plan_wave(members, np.zeros(32), np.ones(32, bool), times, 16, now=100.0)
    assert plan.leaving == list(range(32))  # a 19 ms wave would end past every deadline


def test_a_stall_on_the_first_wave_of_a_grown_batch_makes_members_leave_early_never_late():
    times = WaveTimes()
    for _ in range(10):
        times.add(64, _true_ms(64))
    times.add(576, 100.0)
    assert times.expected_ms(576) >= _true_ms(576)


def test_where_capped_members_fill_the_wave_the_others_are_cut_in_proportion_not_to_one():
    """A capped member's 512 simulations alone take the wave past its target:
    cutting the deadline-only ones to one each would save 13 ms of 69 and
    lose 98 % of their work."""
    times = WaveTimes()
    times.add(16, 5.0 + 0.1 * 16)
    for _ in range(3):
        times.add(512, 5.0 + 0.1 * 512)
    members = [Member(1000, None), Member(None, None), Member(None, None)]
    plan = plan_wave(members, np.zeros(3), np.ones(3, bool), times, 512, wave_target_ms=20.0, now=0.0)
    assert plan.ks.tolist()[0] == 512 and min(plan.ks.tolist()[1:]) >= 16, plan.ks.tolist()


def test_admission_counts_capped_searches_at_k():
    """The plan never cuts capped searches: admission expects the wave with
    them at K (30 at 64: about 43 ms), so a newcomer with 15 ms left is
    refused, not admitted to answer three times past its deadline."""
    from types import SimpleNamespace

    from search_service.wave_loop import Job, Refused, WaveLoop

    times = WaveTimes()
    for n in (64, 1920, 1920, 1920):
        times.add(n, _true_ms(n))
    group = SimpleNamespace(members=[Member(10_000, None, tried=True) for _ in range(30)], queue=[], times=times,
                            k_max=64)
    loop = WaveLoop(backend=None, wave_target_ms=10.0)
    loop._lane = lambda params: group
    with pytest.raises(Refused):
        loop.submit([Job(roots=None, tree=None, params=SimpleNamespace(deadline_ms=15.0, simulations=None))])
    assert loop.in_flight() == 0


def test_admission_does_not_expect_less_than_the_wave_the_plan_runs_with_a_search_capped_below_k():
    """Nine deadline-only searches and one capped at 3 (K 16, target 4 ms):
    counting the capped one at K leaves the others k 1 in admission's estimate
    (3.1 ms; 0.5 ms a wave and 0.1 ms a leaf) where the plan gives them 3
    (3.5 ms without the newcomer); a newcomer with 3.4 ms left would be
    admitted to a wave that ends past its deadline."""
    from types import SimpleNamespace

    from search_service.wave_loop import Job, Refused, WaveLoop

    times = WaveTimes()
    for n in (10, 20, 40, 10, 40, 40):
        times.add(n, 0.5 + 0.1 * n)
    members = [Member(None, None, tried=True) for _ in range(9)] + [Member(3, None, tried=True)]
    newcomer = Member(None, Deadline.after_s(0.0034, 100.0), tried=True)
    plan = plan_wave(members + [newcomer], np.zeros(11), np.ones(11, bool), times, 16, wave_target_ms=4.0, now=100.0)
    planned = times.expected_ms(int(plan.ks.sum()))
    assert planned > 3.4 and plan.leaving == [10]
    loop = WaveLoop(backend=None, wave_target_ms=4.0)
    loop._lane = lambda params: SimpleNamespace(members=members, queue=[], times=times, k_max=16)
    with pytest.raises(Refused):
        loop.submit([Job(roots=None, tree=None, params=SimpleNamespace(deadline_ms=3.4, simulations=None))])


def test_waves_of_about_one_size_do_not_read_their_jitter_as_a_cost_per_leaf():
    """The collapse seen at 8 engines (H100, 2026-12-06): cut waves of 12-20
    leaves whose time jitters by 1.5 ms, beside quicker root-only waves. The
    old estimate ((ms - quickest) / leaves) read that as ~0.1 ms a leaf, so the
    fair share kept cutting the waves to ~3 simulations a tree and members
    left after a wave or two. Sizes this alike give no cost per leaf: the
    waves grow to K, twice the largest at a time, and none leaves with 10 ms
    left."""
    times = WaveTimes()
    for i in range(30):
        if i % 5 == 0:
            times.add(8, 1.2, simulated=False)  # eight roots valued alone
        else:
            times.add(12 + 4 * (i % 3), 2.0 + 0.5 * (i % 4))
    assert times.line()[1] == 0.0
    members = [Member(None, Deadline.after_s(0.010, 100.0), tried=True) for _ in range(8)]
    ks = []
    for _ in range(3):  # no cost per leaf known: each wave grows to at most twice the largest yet
        plan = plan_wave(members, np.zeros(8), np.ones(8, bool), times, 16, wave_target_ms=4.0, now=100.0)
        assert plan.leaving == []
        ks.append(plan.ks.tolist())
        times.add(int(plan.ks.sum()), 2.5)  # and costs what the small ones did
    assert ks == [[5] * 8, [10] * 8, [16] * 8]

"""Roots waiting for the next wave's model call (a join costs no model
call, plan rule 0) and the WaveTimes estimator, on the CPU reference, the
plan and the wave loop: the cases a search must still get right."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from prometheus_client import REGISTRY

from search_service.games import connect4 as c4
from search_service.mcts.backend import EvaluationFailed
from search_service.mcts.batch import leave, run_wave, step
from search_service.mcts.plan import END_DEADLINE, Member, WaveTimes, plan_wave
from search_service.wave_loop import Job, WaveLoop
from tandem.deadline import Deadline

from test_batch import BACKEND, OnnxValueModel, SlowModel, alone, job, params, run_ragged, same_result, same_tree


def vm_job(moves: str, **kw) -> Job:
    return job(moves, evaluator="value_model", **kw)


# -- defects ---------------------------------------------------------------------------------


def test_the_plan_counts_the_roots_its_wave_values_against_a_deadline():
    """A wave that values 50 waiting roots beside one tree's 8 leaves is a call
    of 58 rows, and run_wave records it as 58 leaves; at 1 ms a leaf it takes
    58 ms. The tried member with 20 ms left must leave before it (rule 3),
    but the plan expects the wave of 8 leaves only (8 ms) and keeps it: it is
    answered ~38 ms past its deadline (a SearchBatch of many fresh roots
    joining a busy group)."""
    times = WaveTimes()
    times.add(1, 0.0)
    times.add(100, 100.0)  # no fixed cost, 1 ms a leaf
    now = 100.0
    members = [Member(None, Deadline.after_s(0.020, now), tried=True)] + [Member(None, None) for _ in range(50)]
    ready = np.array([True] + [False] * 50)
    plan = plan_wave(members, np.zeros(51), np.ones(51, bool), times, 8, now=now, ready=ready)
    assert plan.leaving == [0] and members[0].end == END_DEADLINE


def test_a_wave_whose_waiting_roots_the_model_failed_returns_false_beside_rollout_leaves():
    """TreeBatch.wave: False if the model could not value it. The CPU
    reference says so for a root-only wave (wave([0, 0])), and CudaTreeBatch's
    host wave says so whenever the roots' call fails; but where the wave's
    leaves need no model (trees on rollouts, or every leaf terminal)
    _evaluate calls _value_roots_alone and drops its answer: True."""
    model = SlowModel(0.0, fail_after=0)
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=4, evaluator="value_model"), model)
    batch.join(c4.parse_moves("4"), [None], [1], [0])
    assert not batch.wave(np.array([0]))  # tree 0 on rollouts from now on
    batch.join(c4.parse_moves("3"), [None], [2], [0])
    ok = batch.wave(np.array([4, 0]))  # tree 0's rollout leaves, tree 1's root: the model fails it
    assert batch.failed().tolist() == [True, True] and batch.ready().all()
    assert not ok


# -- what held (regression guards) -------------------------------------------------------------


def test_roots_joined_across_waves_valued_after_rows_moved_equal_the_same_searches_alone():
    """Waiting roots whose rows move (a member below them leaves in the plan
    that precedes their valuation), caps of 1 and of less than K, several roots
    valued in one call beside another tree's leaves."""
    model = OnnxValueModel()
    specs = [("4453", 8, 1, 0), ("", 200, 2, 0), ("3344", 1, 3, 2), ("7", 40, 4, 2), ("1", 3, 5, 2),
             ("55", 16, 6, 4), ("2", 1, 7, 5), ("66", 24, 8, 5)]
    together = run_ragged(specs, 8, "value_model", model)
    for i, (moves, sims, seed, _) in enumerate(specs):
        r, t = alone(moves, simulations=sims, seed=seed, parallel_sims=8, evaluator="value_model",
                     evaluator_fn=model)
        assert r.simulations == sims == together[i][0].simulations
        same_result(together[i][0], r)
        same_tree(together[i][1], t)


def test_several_roots_alone_equal_each_alone():
    model = OnnxValueModel()
    roots = ["", "4", "44", "4453"]
    results, trees = BACKEND.search(c4.stack([c4.parse_moves(m) for m in roots]),
                                    params(simulations=33, parallel_sims=8, evaluator="value_model", seed=9), model)
    for i, m in enumerate(roots):
        r, t = BACKEND.search(c4.parse_moves(m), params(simulations=33, parallel_sims=8, evaluator="value_model",
                                                         seed=9), model)
        assert results[i].simulations == 33
        # The stream differs (tree index within its request) but value-model trees draw nothing
        same_result(results[i], r[0])
        same_tree(trees[i], t[0])


def test_a_capped_search_with_a_tiny_deadline_gets_its_root_valued_and_plays_the_policys_move():
    """Its one wave is its root's: the search answers by its deadline with the
    move it has then, the model's policy's, and no simulation."""
    model = OnnxValueModel()
    root = c4.parse_moves("4453")
    (r,), _ = BACKEND.search(root, params(simulations=100, deadline_ms=0.001, parallel_sims=8,
                                          evaluator="value_model", seed=1), model)
    assert r.simulations == r.model_simulations == 0 and r.deadline_reached and r.evaluation_failure == ""
    _, priors = model(c4.observation(root))
    assert r.action == int(np.argmax(np.where(c4.legal_mask(root)[0], priors[0], -1.0)))


def test_run_wave_counts_waiting_roots_as_leaves_and_marks_their_members_tried():
    model = SlowModel(0.0)
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=4, evaluator="value_model"), model)
    batch.join(c4.stack([c4.parse_moves(""), c4.parse_moves("4"), c4.parse_moves("3")]), [None] * 3, [1, 2, 3],
               [0] * 3)
    members = [Member(None, Deadline.after_s(-1.0)) for _ in range(3)]  # deadlines passed
    times = WaveTimes()
    left, ks = leave(batch, members, times)
    assert not left and ks.tolist() == [0, 0, 0]
    run_wave(batch, members, ks, times)
    assert model.calls == 1 and list(times._recent)[0][0] == 3 and all(m.tried for m in members)
    left, ks = leave(batch, members, times)  # valued and past their deadlines: they answer now
    assert len(left) == 3 and all(r.simulations == 0 and r.deadline_reached for _, r, _ in left)


def test_a_root_only_wave_that_fails_times_and_tries_its_members():
    model = SlowModel(0.0, fail_after=0)
    batch = BACKEND.open_batch(params(deadline_ms=1.0, parallel_sims=4, evaluator="value_model"), model)
    batch.join(c4.parse_moves("4"), [None], [1], [0])
    members = [Member(None, Deadline.after_s(-1.0))]
    times = WaveTimes()
    assert step(batch, members, times) == []
    assert times.expected_ms(1) > 0
    (m, r, t), = step(batch, members, times)  # failed: tried; past its deadline: leaves with no simulation
    assert r.simulations == 0 and r.deadline_reached and r.evaluation_failure and int(t.node_visits[0, 0]) == 1


def test_the_wave_loop_answers_searches_that_must_leave_before_their_roots_are_valued():
    """Deadline passed at submit, a caller gone, a session's keep_tree: each
    gets its root valued (its one wave: the first two answer then, with the
    policy's move), and is answered; the loop goes on."""
    loop = WaveLoop(BACKEND, SlowModel(0.002))
    try:
        # Past its deadline already: admitted by an idle group only (a busy one refuses it at once).
        late = Job(c4.parse_moves("4"), None, params(deadline_ms=5000, parallel_sims=4, evaluator="value_model",
                                                      seed=2), deadline=Deadline.after_ms(-1))
        loop.submit([late])
        busy = vm_job("", deadline_ms=2000, parallel_sims=4, seed=1)
        loop.submit([busy])
        gone = Job(c4.parse_moves("3"), None, params(simulations=400, parallel_sims=4, evaluator="value_model",
                                                      seed=3), should_stop=lambda: True, keep_tree=False)
        kept = Job(c4.parse_moves("5"), None, params(simulations=4, parallel_sims=4, evaluator="value_model",
                                                      seed=4), keep_tree=True)
        loop.submit([gone, kept])
        for j in (late, gone, kept):
            assert j.done.wait(30) and j.error is None, j.error
        assert late.result.deadline_reached and late.result.simulations == 0
        assert gone.result.extras["stopped"] and gone.result.simulations == 0
        assert kept.result.simulations == 4 and kept.out_tree is not None
        assert int(kept.out_tree.node_visits[0, 0]) == 5  # its root's evaluation and 4 simulations
        assert busy.done.wait(30) and busy.error is None and busy.result.deadline_reached
    finally:
        loop.close()


def _sample(name: str, **labels) -> float:
    """A sample of this process's /metrics now (0 before the first observation)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_wave_loop_counts_root_only_waves_and_the_time_left_as_searches_join():
    """/metrics tells a root-only wave (phase "roots") from a wave with
    simulations, and how much of each search's deadline was left as it joined
    (at most 0: it arrived spent): where the time of many engines goes."""
    phase, left = "tandem_search_wave_phase_seconds_count", "tandem_search_join_left_seconds"
    before = [_sample(phase, phase="roots"), _sample(phase, phase="wave"), _sample(f"{left}_count"),
              _sample(f"{left}_bucket", le="0.0")]
    loop = WaveLoop(BACKEND, SlowModel(0.0))
    try:
        late = Job(c4.parse_moves("4"), None, params(deadline_ms=5000, parallel_sims=4, evaluator="value_model",
                                                      seed=2), deadline=Deadline.after_ms(-1))
        loop.submit([late])  # alone in an idle group: its root valued by a wave of its own
        assert late.done.wait(30) and late.error is None and late.result.simulations == 0
        capped = vm_job("3", simulations=8, parallel_sims=4, seed=3)
        loop.submit([capped])
        assert capped.done.wait(30) and capped.error is None and capped.result.simulations == 8
    finally:
        loop.close()
    after = [_sample(phase, phase="roots"), _sample(phase, phase="wave"), _sample(f"{left}_count"),
             _sample(f"{left}_bucket", le="0.0")]
    # Each fresh root valued alone first; the capped search's 8 simulations 4 a wave; the capped
    # search has no deadline (not observed), the late one joined spent.
    assert [a - b for a, b in zip(after, before)] == [2, 2, 1, 1]


def test_a_root_only_wave_raising_a_non_evaluation_failure_fails_its_jobs_and_the_loop_serves_on():
    model = SlowModel(0.0, fail_after=0, error=RuntimeError)
    loop = WaveLoop(BACKEND, model)
    try:
        a, b = vm_job("", simulations=8, parallel_sims=4, seed=1), vm_job("4", simulations=8, parallel_sims=4, seed=2)
        loop.submit([a, b])
        assert a.done.wait(30) and b.done.wait(30)
        assert isinstance(a.error, RuntimeError) and isinstance(b.error, RuntimeError)
        model.fail_after = None
        c = vm_job("3", simulations=8, parallel_sims=4, seed=3)
        loop.submit([c])
        assert c.done.wait(30) and c.error is None and c.result.simulations == c.result.model_simulations == 8
        assert loop.in_flight() == 0
    finally:
        loop.close()


def test_the_wave_loop_model_failure_on_roots_goes_on_with_rollouts():
    loop = WaveLoop(BACKEND, SlowModel(0.0, fail_after=0))
    try:
        a = vm_job("", simulations=12, parallel_sims=4, seed=1)
        loop.submit([a])
        assert a.done.wait(30) and a.error is None
        assert a.result.simulations == 12 and a.result.model_simulations == 0 and a.result.evaluation_failure
    finally:
        loop.close()


def test_searches_joining_a_busy_wave_loop_one_by_one_equal_the_same_searches_alone():
    model = OnnxValueModel()
    loop = WaveLoop(BACKEND, model)
    try:
        busy = vm_job("", deadline_ms=3000, parallel_sims=8, seed=1)
        loop.submit([busy])
        jobs = []
        for i in range(6):
            jobs.append(vm_job("4453"[: i % 4], simulations=9 + 7 * i, parallel_sims=8, seed=10 + i))
            loop.submit([jobs[-1]])
            time.sleep(0.003)
        for i, j in enumerate(jobs):
            assert j.done.wait(30) and j.error is None
            r, t = alone("4453"[: i % 4], simulations=9 + 7 * i, seed=10 + i, parallel_sims=8,
                         evaluator="value_model", evaluator_fn=model)
            same_result(j.result, r)
            same_tree(j.out_tree, t)
    finally:
        loop.close()


def busy_group(loop: WaveLoop) -> float:
    """Submits one long value-model search (K = 8) to ``loop``; once its group
    has four waves behind it, the ms its next wave of 16 leaves is expected to take."""
    loop.submit([vm_job("", deadline_ms=5000, parallel_sims=8, seed=1)])
    lane = next(iter(loop._groups.values()))
    deadline = time.monotonic() + 10
    while len(lane.times._history) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    return lane.times.expected_ms(16)


def test_admission_of_a_newcomer_with_time_for_its_waves_and_refusal_without():
    """A busy group of 10 ms waves: a newcomer with 2 s is admitted, one with
    1 ms refused; neither refusal nor admission depends on the roots-only
    wave of the first search (a 1-leaf wave in the history)."""
    from search_service.wave_loop import Refused
    loop = WaveLoop(BACKEND, SlowModel(0.01))
    try:
        expected = busy_group(loop)
        assert 10 <= expected < 40, expected
        with pytest.raises(Refused):
            loop.submit([vm_job("4", deadline_ms=1, parallel_sims=8)])
        ok = vm_job("4", deadline_ms=2000, parallel_sims=8)
        loop.submit([ok])
        assert ok.done.wait(30) and ok.error is None and ok.result.simulations >= 8
    finally:
        loop.close()


def test_admission_asks_a_fresh_value_model_search_for_one_wave_its_roots():
    """A newcomer whose deadline holds the group's next wave once but not
    twice is admitted: that wave values its root, and it answers with the
    policy's move if no wave of simulations fits after it."""
    loop = WaveLoop(BACKEND, SlowModel(0.05))
    try:
        expected = busy_group(loop)
        assert 50 <= expected < 200, expected
        fresh = vm_job("4", deadline_ms=1.8 * expected, parallel_sims=8, seed=2)
        loop.submit([fresh])  # no Refused: one expected wave fits
        assert fresh.done.wait(30) and fresh.error is None
        assert fresh.result.simulations % 8 == 0 and fresh.result.evaluation_failure == ""
    finally:
        loop.close()


# -- WaveTimes ------------------------------------------------------------------------------------


def test_wave_times_with_root_only_waves_recorded_as_leaves():
    """A wave of roots valued alone (no selection, no backup: run_wave passes
    simulated=False) counts for the recent and largest waves, not for the
    cost per leaf: its lower cost is not a cost per leaf."""
    times = WaveTimes(forgive=0)
    times.add(3, 1.0, simulated=False)  # three roots valued alone
    assert times.expected_ms(24) == pytest.approx(1.0) and times.largest() == 3
    for _ in range(3):
        times.add(24, 4.0)
    assert times.line() == (pytest.approx(4.0), 0.0)  # waves of one size: all of it fixed
    assert times.expected_ms(24) == pytest.approx(4.0) and times.largest() == 24
    times.add(8, 1.0 + 8 / 8)  # a small simulated wave: 1 ms fixed, 0.125 ms a leaf
    assert times.line()[1] == pytest.approx((4.0 - 2.0) / (24 - 8))


def test_wave_times_sliced_counts_each_wave_as_one():
    times = WaveTimes(sliced=True)
    for ms in (5.0, 5.2, 4.9, 5.1):
        times.add(10_000, ms)
    assert times.expected_ms(1) == times.expected_ms(10**6) == pytest.approx(5.2)  # the longest: no stall among them


def test_wave_times_add_and_expected_from_two_threads():
    times = WaveTimes()
    stop, errors = threading.Event(), []

    def reader():
        try:
            while not stop.is_set():
                assert times.expected_ms(64) >= 0
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20_000):
        times.add(1 + i % 97, 0.5 + (i % 13) * 0.1)
    stop.set()
    t.join()
    assert not errors


# -- documented rules the new estimator no longer keeps (low) -----------------------------------


def test_a_search_alone_is_expected_to_take_its_longest_recent_wave():
    """plan.py / cpu_reference.py: a search alone (the same leaves every wave)
    is expected to take its longest recent wave (of the last eight). A fit
    over the whole history's median would expect 10 ms after 10 waves of
    10 ms and 8 of 2 ms, for 24 more waves."""
    times = WaveTimes()
    for _ in range(10):
        times.add(8, 10.0)
    for _ in range(8):  # the recent window's length
        times.add(8, 2.0)
    assert times.expected_ms(8) == pytest.approx(2.0)


def test_a_sliced_batch_expects_its_longest_recent_slice():
    """plan.py: sliced, "every wave counts as one leaf, so the next is
    expected to take the longest recent one"; the median of the history enters too."""
    times = WaveTimes(sliced=True)
    for _ in range(10):
        times.add(1, 5.0)
    for _ in range(8):  # the recent window's length
        times.add(1, 0.3)  # capped trees finishing early: short slices
    assert times.expected_ms(1) == pytest.approx(0.3)

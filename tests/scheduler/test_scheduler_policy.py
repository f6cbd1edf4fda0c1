"""Urgency and the scheduling policies (pure functions, no server)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tandem.v1 import scheduler_pb2, search_pb2

from scheduler import policy
from scheduler.policy import REWARD, SEARCH, Decision, ServiceInput, decide, urgency
from tandem.device import NOMINAL_PRIORITY_RANGE
from tandem.stream_priority import PriorityRange, nearest_allowed
from tandem.urgency_weights import DEFAULT_WEIGHTS, UrgencyWeights

H200 = NOMINAL_PRIORITY_RANGE
W = DEFAULT_WEIGHTS


def load(**fields) -> scheduler_pb2.LoadReport:
    return scheduler_pb2.LoadReport(**fields)


# -- urgency --------------------------------------------------------------------------------------


def test_seed_form_phase_times_depth():
    for phase, weight in [(search_pb2.GAME_PHASE_EARLY, W.phase_early), (search_pb2.GAME_PHASE_MID, W.phase_mid),
                          (search_pb2.GAME_PHASE_LATE, W.phase_late)]:
        for depth in (0, 8, 32, 500):
            expected = weight * policy.depth_weight(depth)
            assert urgency(SEARCH, load(phase=phase, search_depth=depth)) == pytest.approx(expected)
    assert policy.depth_weight(0) == 1.0
    assert policy.depth_weight(int(W.depth_reference)) == pytest.approx(1.0 + W.depth_gain)
    assert policy.depth_weight(10_000) == policy.depth_weight(int(W.depth_reference))  # saturates


def test_later_phase_and_deeper_search_are_more_urgent():
    assert urgency(SEARCH, load(phase=search_pb2.GAME_PHASE_LATE)) > urgency(SEARCH, load(phase=search_pb2.GAME_PHASE_MID))
    assert urgency(SEARCH, load(phase=search_pb2.GAME_PHASE_MID)) > urgency(SEARCH, load(phase=search_pb2.GAME_PHASE_EARLY))
    assert urgency(SEARCH, load(search_depth=20)) > urgency(SEARCH, load(search_depth=2))


def test_less_slack_is_more_urgent():
    values = [urgency(SEARCH, load(deadline_slack_ms=s)) for s in (30.0, 10.0, 2.0, -5.0, -100.0)]
    assert values == sorted(values)
    assert values[0] == urgency(SEARCH, load())  # a frame's worth of slack adds nothing
    assert values[2] < values[3]
    # 0 means "not reported" (proto3 default): adds nothing.
    assert urgency(SEARCH, load(deadline_slack_ms=0.0)) == urgency(SEARCH, load())
    # Capped.
    assert policy.slack_term(-1e9) == W.slack_weight * W.slack_cap


def test_older_reward_queue_is_more_urgent():
    values = [urgency(REWARD, load(queue_age_ms=a)) for a in (0.0, 1.0, 5.0, 20.0, 1e9)]
    assert values == sorted(values) and values[0] == 0.0
    assert values[-1] == W.queue_age_weight * W.queue_age_cap
    # A reward service ignores phase and depth (it has neither).
    assert urgency(REWARD, load(phase=search_pb2.GAME_PHASE_LATE, search_depth=99)) == 0.0


def test_no_report_scores_as_empty_report():
    assert urgency(SEARCH, None) == urgency(SEARCH, load()) == W.phase_unspecified
    assert urgency(REWARD, None) == 0.0


def test_unknown_phase_weighs_as_unspecified():
    assert urgency(SEARCH, load(phase=42)) == urgency(SEARCH, load())


@settings(max_examples=300, deadline=None)
@given(
    kind=st.integers(min_value=-5, max_value=10),
    phase=st.integers(min_value=-(2**31), max_value=2**31 - 1),
    depth=st.integers(min_value=0, max_value=2**32 - 1),
    slack=st.floats(allow_nan=True, allow_infinity=True),
    age=st.floats(allow_nan=True, allow_infinity=True),
)
def test_urgency_is_always_finite_and_non_negative(kind, phase, depth, slack, age):
    value = urgency(kind, load(phase=phase, search_depth=depth, deadline_slack_ms=slack, queue_age_ms=age))
    assert math.isfinite(value) and value >= 0.0


def test_weights_validation_names_the_field():
    with pytest.raises(ValueError, match="lower_threshold"):
        UrgencyWeights(raise_threshold=1.0, lower_threshold=1.0)
    with pytest.raises(ValueError, match="static_search_percentage"):
        UrgencyWeights(static_search_percentage=0)
    with pytest.raises(ValueError, match="slack_reference_ms"):
        UrgencyWeights(slack_reference_ms=0.0)
    with pytest.raises(ValueError, match="phase_late"):
        UrgencyWeights(phase_late=float("nan"))


# -- priority range -----------------------------------------------------------------------------


def test_priority_range_and_nearest_allowed():
    assert H200.contains(0) and H200.contains(-5) and not H200.contains(1) and not H200.contains(-6)
    assert H200.step_below_greatest() == -4
    assert PriorityRange(0, 0).step_below_greatest() == 0
    with pytest.raises(ValueError):
        PriorityRange(least=-5, greatest=0)
    assert nearest_allowed(-5, ()) == -5  # any priority in the range
    assert nearest_allowed(-5, (0, -3)) == -3
    assert nearest_allowed(-4, (0, -5)) == 0  # never more urgent than asked
    assert nearest_allowed(-4, (0, -3, -5)) == -3
    assert nearest_allowed(0, (-1, -5)) == -1  # all more urgent: the least urgent of them


# -- policies -----------------------------------------------------------------------------------


def services(search_u: float, reward_u: float, prev: dict[str, Decision] | None = None) -> list[ServiceInput]:
    prev = prev or {}

    def state(key):
        d = prev.get(key)
        return (d.elevated, d.on_top) if d else (False, False)

    return [
        ServiceInput("s", SEARCH, search_u, (0, -4, -5), *state("s")),
        ServiceInput("r", REWARD, reward_u, (0, -4, -5), *state("r")),
    ]


def test_default_policy_puts_everything_at_least():
    out = decide("default", services(9.0, 9.0), H200)
    assert {k: (d.stream_priority, d.active_thread_percentage) for k, d in out.items()} == {
        "s": (0, 100), "r": (0, 100)}


def test_static_policy_equal_priorities_and_thread_split():
    out = decide("static", services(9.0, 0.0), H200)
    assert out["s"].stream_priority == out["r"].stream_priority == 0
    assert (out["s"].active_thread_percentage, out["r"].active_thread_percentage) == (50, 50)
    w = UrgencyWeights(static_search_percentage=70, static_reward_percentage=30)
    out = decide("static", services(0.0, 0.0), H200, w)
    assert (out["s"].active_thread_percentage, out["r"].active_thread_percentage) == (70, 30)


def test_dynamic_raises_urgent_search_to_greatest_and_drops_back_with_hysteresis():
    out = decide("dynamic", services(1.0, 0.0), H200)
    assert out["s"].stream_priority == 0 and not out["s"].elevated
    out = decide("dynamic", services(W.raise_threshold, 0.0, out), H200)
    assert out["s"].stream_priority == -5 and out["s"].elevated
    assert out["r"].stream_priority == 0  # reward stays at least unless more urgent
    out = decide("dynamic", services(W.lower_threshold, 0.0, out), H200)  # inside the band: stays
    assert out["s"].stream_priority == -5
    out = decide("dynamic", services(W.lower_threshold - 0.01, 0.0, out), H200)
    assert out["s"].stream_priority == 0 and not out["s"].elevated


def test_dynamic_reward_takes_the_top_only_when_clearly_more_urgent():
    prev = decide("dynamic", services(3.0, 3.0), H200)  # both elevated, equal: search keeps the top
    assert prev["s"].stream_priority == -5 and prev["r"].stream_priority == 0
    out = decide("dynamic", services(3.0, 3.0 + W.outrank_margin / 2, prev), H200)
    assert out["r"].stream_priority == 0  # not by the margin
    out = decide("dynamic", services(3.0, 3.0 + W.outrank_margin * 2, out), H200)
    assert out["r"].stream_priority == -5 and out["r"].on_top
    assert out["s"].stream_priority == -4  # one step down, still above least
    out = decide("dynamic", services(3.0, 3.0 - W.outrank_margin / 2, out), H200)
    assert out["r"].on_top  # keeps the top inside the margin (hysteresis)
    out = decide("dynamic", services(3.0, 3.0 - W.outrank_margin * 2, out), H200)
    assert not out["r"].on_top and out["r"].stream_priority == 0 and out["s"].stream_priority == -5


def test_dynamic_reward_alone_when_elevated():
    out = decide("dynamic", [ServiceInput("r", REWARD, 4.0, ())], H200)
    assert out["r"].stream_priority == -5


def test_dynamic_maps_onto_registered_priorities():
    out = decide("dynamic", [ServiceInput("s", SEARCH, 9.0, (0, -2))], H200)
    assert out["s"].stream_priority == -2


def test_single_level_device_gives_everyone_the_same_priority():
    one = PriorityRange(0, 0)
    out = decide("dynamic", services(9.0, 9.0), one)
    assert out["s"].stream_priority == out["r"].stream_priority == 0


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        decide("fifo", [], H200)


def _run_dynamic(urgencies: np.ndarray, w: UrgencyWeights = W) -> list[int]:
    prev: dict[str, Decision] = {}
    priorities = []
    for u in urgencies:
        prev = decide("dynamic", [ServiceInput("s", SEARCH, float(u), (0, -5), *(
            (prev["s"].elevated, prev["s"].on_top) if prev else (False, False)))], H200, w)
        priorities.append(prev["s"].stream_priority)
    return priorities


def _switches(values: list[int]) -> int:
    return sum(a != b for a, b in zip(values, values[1:]))


def test_dynamic_does_not_flap_under_noisy_urgency():
    rng = np.random.default_rng(7)
    band = W.raise_threshold - W.lower_threshold
    # Noise of nearly half the band around the band's middle: a bare threshold flaps, hysteresis does not.
    mid = (W.raise_threshold + W.lower_threshold) / 2
    noisy = mid + rng.uniform(-0.49 * band, 0.49 * band, size=2000)
    assert _switches(_run_dynamic(noisy)) == 0
    bare = [(-5 if u >= mid else 0) for u in noisy]
    assert _switches(bare) > 100
    # A slow swing across the whole band plus the same noise: one switch per real crossing.
    t = np.arange(4000)
    swing = mid + 2 * band * np.sin(2 * np.pi * t / 1000) + rng.uniform(-0.49 * band, 0.49 * band, size=t.size)
    priorities = _run_dynamic(swing)
    assert _switches(priorities) <= 8  # 4 periods: up and down once each
    assert set(priorities) == {0, -5}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=DEFAULT_WEIGHTS.lower_threshold,
                          max_value=DEFAULT_WEIGHTS.raise_threshold, exclude_max=True), min_size=1, max_size=50),
       st.booleans())
def test_dynamic_state_never_changes_inside_the_band(urgencies, start_elevated):
    prev = ServiceInput("s", SEARCH, 0.0, (), start_elevated)
    for u in urgencies:
        d = decide("dynamic", [ServiceInput("s", SEARCH, u, (), prev.elevated)], H200)["s"]
        assert d.elevated == start_elevated
        prev = ServiceInput("s", SEARCH, u, (), d.elevated)


# -- the lever over bulk work ---------------------------------------------------------------------

def _reward(critical_ms: float) -> tuple[int, scheduler_pb2.LoadReport]:
    return REWARD, scheduler_pb2.LoadReport(critical_latency_ms=critical_ms)


def _search(slack_ms: float) -> tuple[int, scheduler_pb2.LoadReport]:
    return SEARCH, scheduler_pb2.LoadReport(deadline_slack_ms=slack_ms)


def test_frames_at_risk_rises_at_the_raise_threshold_and_falls_below_the_lower_one():
    raise_ms, lower_ms = W.bulk_raise_critical_ms, W.bulk_lower_critical_ms
    assert not policy.frames_at_risk([_reward(raise_ms - 0.01)], False)
    assert policy.frames_at_risk([_reward(raise_ms)], False)
    between = (raise_ms + lower_ms) / 2
    assert policy.frames_at_risk([_reward(between)], True)  # hysteresis: stays at risk
    assert not policy.frames_at_risk([_reward(between)], False)
    assert not policy.frames_at_risk([_reward(lower_ms - 0.01)], True)
    # The worst reward service counts; a search that overran its deadline puts frames at risk on its own.
    assert policy.frames_at_risk([_reward(0.1), _reward(raise_ms + 1)], False)
    assert policy.frames_at_risk([_reward(0.1), _search(-0.5)], False)
    assert not policy.frames_at_risk([_search(3.0), (SEARCH, None), (REWARD, None)], False)
    # 0 slack means "not reported"; NaN counts as not reported.
    assert not policy.frames_at_risk([_search(0.0), _reward(math.nan)], False)


def test_bulk_share_default_none_static_fixed_dynamic_aimd():
    assert policy.next_bulk_share("default", 30, True) == 100
    assert policy.next_bulk_share("static", 100, False) == W.static_bulk_share_percent
    assert policy.next_bulk_share("static", 10, True) == W.static_bulk_share_percent
    share, seen = 100, []
    for _ in range(6):  # at risk: halves each report, down to the floor
        share = policy.next_bulk_share("dynamic", share, True)
        seen.append(share)
    assert seen == [50, 25, 12, W.bulk_min_share_percent, W.bulk_min_share_percent, W.bulk_min_share_percent]
    for _ in range(20):  # safe again: grows by a fixed step, up to 100
        share = policy.next_bulk_share("dynamic", share, False)
    assert share == 100
    assert policy.next_bulk_share("dynamic", 40, False) == 40 + W.bulk_increase_percent


def test_bulk_weights_are_checked_naming_the_field():
    for fields, name in [(dict(bulk_lower_critical_ms=5.0), "bulk_lower_critical_ms"),
                         (dict(bulk_decrease_factor=1.0), "bulk_decrease_factor"),
                         (dict(static_bulk_share_percent=0), "static_bulk_share_percent"),
                         (dict(bulk_min_share_percent=101), "bulk_min_share_percent")]:
        with pytest.raises(ValueError, match=name):
            UrgencyWeights(**fields)

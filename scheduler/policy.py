"""Urgency and scheduling policies, as pure functions.

Nothing here touches a lock, a clock, a GPU or gRPC: the servicer
(:mod:`scheduler.server`) gathers the inputs under its lock, calls
:func:`urgency` and :func:`decide`, and stores what they return. That keeps
every rule testable on its own (``tests/scheduler/test_scheduler_policy.py``).

Urgency (dimensionless, finite, >= 0; larger is more urgent)
------------------------------------------------------------
The seed's form, plus two terms::

    urgency = phase_weight[phase] * depth_weight(search_depth)     (search only)
            + slack_term(deadline_slack_ms)                         (less slack: larger)
            + queue_age_term(queue_age_ms)                          (older queue: larger)

* ``depth_weight(d) = 1 + depth_gain * min(d, depth_reference) / depth_reference``:
  1 at depth 0, ``1 + depth_gain`` from ``depth_reference`` on.
* ``slack_term(s) = slack_weight * clamp(1 - s / slack_reference_ms, 0, slack_cap)``:
  0 with a frame's worth of slack or more, ``slack_weight`` with none left,
  up to ``slack_weight * slack_cap`` for a missed deadline (negative slack).
  A slack of exactly 0 means "not reported" (proto3 cannot tell the two
  apart) and adds nothing; a service that has truly run out of time reports a
  negative number.
* ``queue_age_term(a) = queue_age_weight * min(a / queue_age_reference_ms, queue_age_cap)``.

A reward service has no game phase nor depth, so its urgency is the two
additive terms alone (it is "more urgent" than a search only when its queue
is old). Inputs are sanitised, never refused: NaN counts as "not reported",
infinities saturate at the caps, negative ages count as 0, unknown phases
weigh as unspecified.

Policies
--------
Each policy maps the live services onto CUDA stream priorities of the device
(:class:`PriorityRange`: ``least`` is 0 on every NVIDIA GPU, ``greatest`` is
-5 on the H200; lower numbers are more urgent):

* ``default`` -- every service at ``least``, 100 % of the SMs' threads.
* ``dynamic`` -- a search service is *elevated* once its urgency reaches
  ``raise_threshold`` and stays elevated until it falls below
  ``lower_threshold`` (hysteresis, so a noisy urgency does not flap the
  assignment). Elevated searches get ``greatest``. A reward service stays at
  ``least`` unless it is elevated too *and* more urgent than every elevated
  search by ``outrank_margin`` (it then keeps the top while it is within
  ``outrank_margin`` below them: hysteresis again); on top it gets
  ``greatest`` and the elevated searches step one level down.
* ``static`` -- every service at ``least`` (equal priorities) and an MPS
  active-thread share per kind (``static_search_percentage``,
  ``static_reward_percentage``).

A service may only use the priorities it registered streams for; the chosen
level is mapped onto the most urgent of those that does not exceed it
(:func:`nearest_allowed`).

The lever over bulk work
------------------------
Stream priorities decide which *waiting* thread blocks an SM takes next; they
do not stop a bulk batch that already fills the GPU, and a critical kernel
still waits for the bulk blocks in front of it. So the scheduler also sets
the **bulk share**: the share of wall time (1..100 %) each reward model's bulk
lane may spend running batches (the lane idles after a batch that took t ms
for ``t * (100 / share - 1)`` ms, reward_service/batcher.py).

* ``default`` -- 100 % (no lever: the baseline).
* ``static`` -- ``static_bulk_share_percent``, always.
* ``dynamic`` -- additive increase, multiplicative decrease (as TCP's
  congestion control, Chiu & Jain 1989) driven by :func:`frames_at_risk`: on
  each load report of a reward service, its share is multiplied by
  ``bulk_decrease_factor`` while frames are at risk (not below
  ``bulk_min_share_percent``), and grows by ``bulk_increase_percent`` (up to
  100) while they are not. Frames are at risk once a reward service's critical
  queue + model p95 reaches ``bulk_raise_critical_ms`` or a search overruns its
  deadline; they stay so until every critical p95 is below
  ``bulk_lower_critical_ms`` and no search overran (hysteresis).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from tandem.v1 import scheduler_pb2

from tandem.stream_priority import PriorityRange, nearest_allowed
from tandem.urgency_weights import DEFAULT_WEIGHTS, UrgencyWeights

SEARCH = scheduler_pb2.SERVICE_KIND_SEARCH
REWARD = scheduler_pb2.SERVICE_KIND_REWARD

POLICIES = ("default", "dynamic", "static")




def _finite_or(value: float, default: float) -> float:
    return default if math.isnan(value) else value


def depth_weight(depth: int, w: UrgencyWeights = DEFAULT_WEIGHTS) -> float:
    """``1 + depth_gain * min(depth, depth_reference) / depth_reference``; negative depths count as 0."""
    d = min(max(float(depth), 0.0), w.depth_reference)
    return 1.0 + w.depth_gain * d / w.depth_reference


def slack_term(deadline_slack_ms: float, w: UrgencyWeights = DEFAULT_WEIGHTS) -> float:
    """Urgency added by the frame time left (ms); 0 (= not reported) and NaN add nothing."""
    s = _finite_or(float(deadline_slack_ms), 0.0)
    if s == 0.0:
        return 0.0
    fraction = 1.0 - s / w.slack_reference_ms  # +inf slack -> -inf, -inf slack -> +inf
    return w.slack_weight * min(max(fraction, 0.0), w.slack_cap)


def queue_age_term(queue_age_ms: float, w: UrgencyWeights = DEFAULT_WEIGHTS) -> float:
    """Urgency added by the age (ms) of the oldest queued request; NaN and negatives add nothing."""
    a = max(_finite_or(float(queue_age_ms), 0.0), 0.0)
    return w.queue_age_weight * min(a / w.queue_age_reference_ms, w.queue_age_cap)


def urgency(kind: int, load: scheduler_pb2.LoadReport | None, w: UrgencyWeights = DEFAULT_WEIGHTS) -> float:
    """Urgency of a service of ``kind`` (``ServiceKind``) given its latest report.

    ``load`` None (no report yet) scores as an empty report. Always returns a
    finite number >= 0, whatever the report holds.
    """
    load = load if load is not None else scheduler_pb2.LoadReport()
    value = slack_term(load.deadline_slack_ms, w) + queue_age_term(load.queue_age_ms, w)
    if kind == SEARCH:
        value += w.phase_weight(load.phase) * depth_weight(load.search_depth, w)
    return value if math.isfinite(value) else 0.0


@dataclass(frozen=True)
class ServiceInput:
    """What a policy knows of one live service.

    ``elevated`` and ``on_top`` are the policy state returned by the previous
    :func:`decide` for this service (False for a new one).
    ``allowed_priorities`` empty means: any priority in the device's range.
    """

    key: str
    kind: int
    urgency: float
    allowed_priorities: tuple[int, ...] = ()
    elevated: bool = False
    on_top: bool = False


@dataclass(frozen=True)
class Decision:
    """What a policy assigns one service, and the state to feed back next time."""

    stream_priority: int
    active_thread_percentage: int  # MPS share under "static", else 100
    elevated: bool = False
    on_top: bool = False


def next_elevated(value: float, was_elevated: bool, w: UrgencyWeights = DEFAULT_WEIGHTS) -> bool:
    """Hysteresis: rise at ``>= raise_threshold``, fall at ``< lower_threshold``."""
    if was_elevated:
        return value >= w.lower_threshold
    return value >= w.raise_threshold


def decide_default(services: Sequence[ServiceInput], prange: PriorityRange,
                   w: UrgencyWeights = DEFAULT_WEIGHTS) -> dict[str, Decision]:
    """Every service at the least priority with all threads."""
    return {s.key: Decision(nearest_allowed(prange.least, s.allowed_priorities), 100) for s in services}


def decide_static(services: Sequence[ServiceInput], prange: PriorityRange,
                  w: UrgencyWeights = DEFAULT_WEIGHTS) -> dict[str, Decision]:
    """Equal (least) priorities; an MPS active-thread share per kind."""
    share = {SEARCH: w.static_search_percentage, REWARD: w.static_reward_percentage}
    return {
        s.key: Decision(nearest_allowed(prange.least, s.allowed_priorities), share.get(s.kind, 100))
        for s in services
    }


def decide_dynamic(services: Sequence[ServiceInput], prange: PriorityRange,
                   w: UrgencyWeights = DEFAULT_WEIGHTS) -> dict[str, Decision]:
    """Priorities from urgency with hysteresis (see the module docstring)."""
    elevated = {s.key: next_elevated(s.urgency, s.elevated, w) for s in services}
    search_urgencies = [s.urgency for s in services if s.kind == SEARCH and elevated[s.key]]
    top_search = max(search_urgencies, default=None)

    on_top: dict[str, bool] = {}
    for s in services:
        if s.kind == SEARCH or not elevated[s.key]:
            on_top[s.key] = False
        elif top_search is None:
            on_top[s.key] = True
        elif s.on_top:
            on_top[s.key] = s.urgency >= top_search - w.outrank_margin
        else:
            on_top[s.key] = s.urgency > top_search + w.outrank_margin
    background_on_top = any(on_top.values())

    out: dict[str, Decision] = {}
    for s in services:
        if on_top[s.key]:
            target = prange.greatest
        elif s.kind == SEARCH and elevated[s.key]:
            target = prange.step_below_greatest() if background_on_top else prange.greatest
        else:
            target = prange.least
        out[s.key] = Decision(
            nearest_allowed(target, s.allowed_priorities), 100, elevated[s.key], on_top[s.key]
        )
    return out


def frames_at_risk(loads: Iterable[tuple[int, scheduler_pb2.LoadReport | None]], was_at_risk: bool,
                   w: UrgencyWeights = DEFAULT_WEIGHTS) -> bool:
    """Whether frames are at risk, from every live service's latest report.

    ``loads``: (``ServiceKind``, latest ``LoadReport`` or None) per service.
    At risk when a search's reported ``deadline_slack_ms`` is below
    ``-bulk_raise_overrun_ms`` (0 means "not reported"), or the largest reward
    ``critical_latency_ms`` (ms) reaches ``bulk_raise_critical_ms`` -- or, when
    ``was_at_risk``, is still at or above ``bulk_lower_critical_ms``. NaN counts
    as not reported.
    """
    worst_critical_ms, overrun = 0.0, False
    for kind, load in loads:
        if load is None:
            continue
        if kind == REWARD:
            worst_critical_ms = max(worst_critical_ms, _finite_or(load.critical_latency_ms, 0.0))
        elif kind == SEARCH:
            slack = _finite_or(load.deadline_slack_ms, 0.0)
            overrun = overrun or (slack != 0.0 and slack < -w.bulk_raise_overrun_ms)
    threshold = w.bulk_lower_critical_ms if was_at_risk else w.bulk_raise_critical_ms
    return overrun or worst_critical_ms >= threshold


def next_bulk_share(policy: str, previous_percent: int, at_risk: bool, w: UrgencyWeights = DEFAULT_WEIGHTS) -> int:
    """A reward service's next bulk share (percent of wall time, 1..100) under ``policy``.

    Called once per load report of that service (and with 100 and False at
    registration). Unknown policies get 100.
    """
    if policy == "static":
        return w.static_bulk_share_percent
    if policy != "dynamic":
        return 100
    if at_risk:
        return max(w.bulk_min_share_percent, int(previous_percent * w.bulk_decrease_factor))
    return min(100, previous_percent + w.bulk_increase_percent)


_POLICIES = {"default": decide_default, "dynamic": decide_dynamic, "static": decide_static}


def decide(policy: str, services: Sequence[ServiceInput], prange: PriorityRange,
           w: UrgencyWeights = DEFAULT_WEIGHTS) -> Mapping[str, Decision]:
    """Runs ``policy`` ("default", "dynamic" or "static") over all live services.

    Returns one :class:`Decision` per ``ServiceInput.key``.

    Raises:
        ValueError: unknown policy name.
    """
    try:
        fn = _POLICIES[policy]
    except KeyError:
        raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {policy!r}") from None
    return fn(services, prange, w)

"""The scheduler's urgency weights: a section of the config schema
(``scheduler.urgency`` in the YAML file), read by :mod:`tandem.config` and
used by the scheduler's policies (``scheduler/policy.py``, where the urgency
formula is written out)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.v1 import search_pb2


@dataclass(frozen=True)
class UrgencyWeights:
    """Every tunable of urgency and of the policies, in one place.

    Defaults are module-level (:data:`DEFAULT_WEIGHTS`); the YAML file sets
    them in ``scheduler.urgency`` (tandem/config.py). Units are in the names.

    Raises:
        ValueError: a weight is negative or not finite, a reference is not
            positive, ``lower_threshold >= raise_threshold``, or a percentage
            lies outside 1..100.
    """

    # Seed form: phase_weight[phase] * depth_weight(depth).
    phase_unspecified: float = 1.0
    phase_early: float = 0.75
    phase_mid: float = 1.0
    phase_late: float = 1.5
    depth_reference: float = 32.0  # depth at which depth_weight saturates
    depth_gain: float = 1.0  # depth_weight goes from 1 to 1 + depth_gain
    # Deadline slack (search): less slack left in the frame is more urgent.
    slack_weight: float = 1.0
    slack_reference_ms: float = 16.7  # one 60 FPS frame: this much slack or more adds 0
    slack_cap: float = 2.0  # a deadline missed by a full reference adds slack_weight * 2
    # Queue age (reward): an older queued request is more urgent.
    queue_age_weight: float = 1.0
    queue_age_reference_ms: float = 5.0
    queue_age_cap: float = 4.0
    # "dynamic": hysteresis band for elevating a search service.
    raise_threshold: float = 2.0
    lower_threshold: float = 1.5
    outrank_margin: float = 0.5  # a reward service must beat the searches by this to take the top
    # "static": MPS active-thread percentage per kind.
    static_search_percentage: int = 50
    static_reward_percentage: int = 50
    # The lever over bulk work: the share of wall time (1..100 %) each reward
    # model's bulk lane may run batches. "static": a fixed share. "dynamic":
    # frames are at risk once a reward service's critical queue + model p95
    # reaches bulk_raise_critical_ms or a search overruns its deadline by more
    # than bulk_raise_overrun_ms; they stay at risk until every critical p95 is
    # below bulk_lower_critical_ms and no search overran (hysteresis). At risk,
    # each reward report multiplies the share by bulk_decrease_factor (not below
    # bulk_min_share_percent); otherwise it adds bulk_increase_percent, up to
    # 100 (additive increase, multiplicative decrease, as TCP's congestion control).
    static_bulk_share_percent: int = 50
    bulk_raise_critical_ms: float = 4.0  # a quarter of a 60 FPS frame
    bulk_lower_critical_ms: float = 2.0
    bulk_raise_overrun_ms: float = 0.0
    bulk_decrease_factor: float = 0.5
    bulk_increase_percent: int = 10
    bulk_min_share_percent: int = 10

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"UrgencyWeights.{name}: must be finite and >= 0, got {value}")
        for name in ("depth_reference", "slack_reference_ms", "queue_age_reference_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"UrgencyWeights.{name}: must be > 0, got {getattr(self, name)}")
        if self.lower_threshold >= self.raise_threshold:
            raise ValueError(
                "UrgencyWeights.lower_threshold: must be below raise_threshold "
                f"({self.lower_threshold} >= {self.raise_threshold})"
            )
        if self.bulk_lower_critical_ms >= self.bulk_raise_critical_ms:
            raise ValueError(
                "UrgencyWeights.bulk_lower_critical_ms: must be below bulk_raise_critical_ms "
                f"({self.bulk_lower_critical_ms} >= {self.bulk_raise_critical_ms})"
            )
        if not 0 < self.bulk_decrease_factor < 1:
            raise ValueError(
                f"UrgencyWeights.bulk_decrease_factor: must lie in (0, 1), got {self.bulk_decrease_factor}"
            )
        for name in ("static_search_percentage", "static_reward_percentage", "static_bulk_share_percent",
                     "bulk_increase_percent", "bulk_min_share_percent"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 100:
                raise ValueError(f"UrgencyWeights.{name}: must be an integer in 1..100, got {value!r}")

    def phase_weight(self, phase: int) -> float:
        """Weight of a ``search_pb2.GamePhase`` value; unknown values weigh as unspecified."""
        return {
            search_pb2.GAME_PHASE_EARLY: self.phase_early,
            search_pb2.GAME_PHASE_MID: self.phase_mid,
            search_pb2.GAME_PHASE_LATE: self.phase_late,
        }.get(phase, self.phase_unspecified)


DEFAULT_WEIGHTS = UrgencyWeights()

"""The time one search may take (ms): what the request asks, capped by the
caller's gRPC deadline less a reply margin and by the service's own limit.

Every search ends by this time, with the best move found so far (``deadline_reached``):
a request without ``deadline_ms`` is not open-ended (``search.max_deadline_ms``
bounds it), and one whose gRPC deadline is nearer than its ``deadline_ms``
stops early enough for its answer to arrive in time. The backends do not start
a wave they expect to end past it (``search_service.mcts.plan.WaveTimes``).
"""
from __future__ import annotations

from tandem.deadline import Deadline

# The answer still has to be built, sent and decoded after the search stops:
# leave that a share of the time left, within these bounds (ms).
# (On a loaded 2-core host the reply took up to ~2 ms on loopback: bench/deadline_answers.py.)
REPLY_MARGIN_SHARE = 0.15
REPLY_MARGIN_MIN_MS = 2.0
REPLY_MARGIN_MAX_MS = 50.0
MIN_SEARCH_MS = 0.1  # a deadline already (nearly) passed still answers: at most one wave


def reply_margin_ms(left_ms: float) -> float:
    """Time kept back for the reply when ``left_ms`` remain before the gRPC deadline (ms)."""
    return min(max(REPLY_MARGIN_SHARE * left_ms, REPLY_MARGIN_MIN_MS), REPLY_MARGIN_MAX_MS)


def spent(grpc_remaining_s: float) -> bool:
    """Whether a call with ``grpc_remaining_s`` left of its gRPC deadline (s)
    has no time left for a search: all of it is the reply's margin."""
    left_ms = grpc_remaining_s * 1e3
    return left_ms <= reply_margin_ms(left_ms)


def search_deadline_ms(requested_ms: float, grpc_remaining_s: float | None, max_ms: float) -> float:
    """The search's own deadline (ms from now), > 0.

    Args:
        requested_ms: ``SearchRequest.deadline_ms`` (0: none asked; checked
            finite and >= 0 by the caller).
        grpc_remaining_s: ``context.time_remaining()`` (s; None: no gRPC deadline).
        max_ms: ``search.max_deadline_ms``, the longest any search runs.
    """
    deadline = min(requested_ms, max_ms) if requested_ms else max_ms
    if grpc_remaining_s is not None:
        left_ms = grpc_remaining_s * 1e3
        deadline = min(deadline, max(left_ms - reply_margin_ms(left_ms), MIN_SEARCH_MS))
    return deadline


def search_deadline(requested_ms: float, caller: Deadline | None, max_ms: float,
                    now: float | None = None) -> tuple[float, Deadline]:
    """The search's own budget and deadline: (:func:`search_deadline_ms`, > 0
    ms, and the instant it ends, that many ms from ``now``). The budget is
    kept as computed, not read back from the instant: a budget far below the
    clock's resolution (``deadline_ms`` 1e-300) is still > 0.

    Args:
        requested_ms: as :func:`search_deadline_ms`'s.
        caller: the caller's gRPC deadline (``Deadline.of_grpc``); None: none.
        max_ms: ``search.max_deadline_ms``.
        now: ``time.monotonic()`` s when the request was received (None: read it).
    """
    now = Deadline.now() if now is None else now
    remaining_s = None if caller is None else caller.left_s(now)
    ms = search_deadline_ms(requested_ms, remaining_s, max_ms)
    return ms, Deadline.after_ms(ms, now)

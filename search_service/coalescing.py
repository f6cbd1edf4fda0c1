"""Leaves of concurrent searches in one model call.

Each search of a wave asks for its leaves' values; without this, N searches
in flight make N ``Evaluate`` calls, each paying the gRPC round trip. Here a
dispatcher thread sends everything queued as ONE call, and while that call is
in flight the next searches' leaves queue up for the next one (group commit,
as databases batch log writes; the reward service's batcher does the same
for requests that meet in its queue). An idle service adds one thread
hand-off per call; the call then carries every search waiting.

Invariants (all under ``_lock``): ``_queue`` holds the requests not yet
taken by the dispatcher; a request is answered exactly once (values or an
error), by the dispatcher, after which its ``done`` event is set. A caller
waits at most until its own deadline: past it, it gives up with
EvaluationFailed, and its rows, if already sent, are dropped from the answer.
The combined call's deadline is the latest of its requests' (a request
without a deadline: the evaluator's own timeout).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Histogram

from search_service.mcts.backend import EvaluationFailed
from tandem.deadline import Deadline

CALL_ROWS = Histogram("tandem_search_coalesced_rows", "Leaves per coalesced model call.",
                      buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
CALL_SEARCHES = Histogram("tandem_search_coalesced_requests", "Searches' requests per coalesced model call.",
                          buckets=(1, 2, 4, 8, 16, 32, 64))


@dataclass(eq=False)  # compared by identity, never by its arrays
class _Request:
    obs: np.ndarray  # uint8 [M, 2, 6, 7]
    deadline: Deadline | None
    done: threading.Event = field(default_factory=threading.Event)
    values: np.ndarray | None = None  # float32 [M], once answered
    priors: np.ndarray | None = None  # float32 [M, A] or None
    error: EvaluationFailed | None = None


class CoalescingEvaluator:
    """One model call for the leaves of every search waiting.

    Args:
        inner: ``inner(obs uint8 [M, 2, 6, 7], deadline: Deadline | None) ->
            (values float32 [M], priors float32 [M, A] or None)``; raises EvaluationFailed.
        max_rows: most leaves in one call (more wait for the next one).
    """

    def __init__(self, inner, max_rows: int = 4096):
        self.inner, self.max_rows = inner, max_rows
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: list[_Request] = []  # guarded by _lock
        self._closed = False  # guarded by _lock
        self.calls = 0  # model calls made (tests read it); written by the dispatcher only
        self._thread = threading.Thread(target=self._dispatch, name="coalescing-evaluator", daemon=True)
        self._thread.start()

    def until(self, deadline: Deadline | None):
        """This evaluator with the wait and the call bound by ``deadline``."""
        return lambda observations: self(observations, deadline)

    def __call__(self, observations, deadline: Deadline | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Values float32 [N] and priors float32 [N, A] or None, for observations uint8 [N, 2, 6, 7].

        Raises:
            EvaluationFailed: the model call failed, the evaluator is closed,
                or ``deadline`` passed before the answer came.
        """
        req = _Request(np.ascontiguousarray(observations, np.uint8), deadline)
        with self._lock:
            if self._closed:
                raise EvaluationFailed("leaf evaluator closed")
            self._queue.append(req)
            self._wake.notify()
        if not req.done.wait(None if deadline is None else deadline.wait_s()):
            raise EvaluationFailed("reward service: DEADLINE_EXCEEDED (waiting for a coalesced model call)")
        if req.error is not None:
            raise req.error
        return req.values, req.priors

    def close(self) -> None:
        """Stops the dispatcher; requests still queued fail with EvaluationFailed."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(5)

    def _take(self) -> list[_Request] | None:
        """The next call's requests (up to ``max_rows`` leaves, at least one request); None once closed."""
        with self._lock:
            while not self._queue and not self._closed:
                self._wake.wait()
            if self._closed:
                for r in self._queue:
                    r.error = EvaluationFailed("leaf evaluator closed")
                    r.done.set()
                self._queue.clear()
                return None
            taken, rows = [], 0
            while self._queue and (not taken or rows + len(self._queue[0].obs) <= self.max_rows):
                taken.append(self._queue.pop(0))
                rows += len(taken[-1].obs)
            return taken

    def _dispatch(self) -> None:
        while (taken := self._take()) is not None:
            now = Deadline.now()
            live = []
            for r in taken:
                if r.deadline is None or not r.deadline.passed(now):
                    live.append(r)
                else:  # its caller has given up waiting: answer it, never send it
                    r.error = EvaluationFailed("reward service: DEADLINE_EXCEEDED (before the call)")
                    r.done.set()
            if live:
                self._answer(live)

    def _answer(self, requests: list[_Request]) -> None:
        deadlines = [r.deadline for r in requests]
        deadline = None if None in deadlines else max(deadlines)
        obs = np.concatenate([r.obs for r in requests])
        CALL_ROWS.observe(len(obs))
        CALL_SEARCHES.observe(len(requests))
        self.calls += 1
        try:
            values, priors = self.inner(obs, deadline)
        except EvaluationFailed as exc:
            for r in requests:
                r.error = exc
                r.done.set()
            return
        except Exception as exc:  # a broken answer fails its requests, never the dispatcher
            for r in requests:
                r.error = EvaluationFailed(f"leaf evaluator: {type(exc).__name__}: {exc}")
                r.done.set()
            return
        values = np.asarray(values, np.float32).reshape(-1)
        start = 0
        for r in requests:
            end = start + len(r.obs)
            r.values = values[start:end]
            r.priors = None if priors is None else np.asarray(priors, np.float32)[start:end]
            r.done.set()
            start = end

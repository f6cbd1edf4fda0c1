"""An evaluation cache: the value model's answers for positions it has seen.

Consecutive frames of one game search overlapping trees, and transpositions
reach one position by several move orders, so many leaves repeat. The cache
keeps each evaluated position's value and priors, keyed by its observation's
84 bytes (uint8 [2, 6, 7]: the position exactly, from the side to move's
view), and drops the least recently used entries beyond its byte budget.
Transposition tables of this kind are as old as game-tree search (Greenblatt
et al. 1967); KataGo and Leela Chess Zero keep one for their network's
outputs.

Thread safety: one lock guards the table and the counters; the model call of
the misses runs outside it, so concurrent searches only wait for each other's
look-ups. Two searches missing on the same position both evaluate it (the
answers are equal); the later store wins.
"""
from __future__ import annotations

import collections
import threading

import numpy as np
from prometheus_client import Counter, Gauge

from search_service.games import connect4
from tandem.deadline import Deadline

A = connect4.NUM_ACTIONS
# Bytes one entry holds, measured with sys.getsizeof in CPython 3.11: the key
# (bytes of 84: 117), the value tuple (56 + float 24 + priors bytes of 28: 61),
# and the ordered dict's slot and links (~100), rounded up.
ENTRY_BYTES = 360

LOOKUPS = Counter("tandem_search_eval_cache_lookups", "Leaf evaluations asked of the cache.", ["result"])
ENTRIES = Gauge("tandem_search_eval_cache_entries", "Positions held by the evaluation cache.",
                multiprocess_mode="livesum")


class EvaluationCache:
    """Values and priors by position, least recently used first out.

    Args:
        max_bytes: budget in bytes (``max_bytes // ENTRY_BYTES`` entries);
            0 keeps nothing.
    """

    def __init__(self, max_bytes: int):
        self.capacity = max(int(max_bytes) // ENTRY_BYTES, 0)
        self._lock = threading.Lock()
        self._table: collections.OrderedDict[bytes, tuple[float, bytes | None]] = collections.OrderedDict()  # guarded
        self.hits = 0  # guarded by _lock
        self.misses = 0  # guarded by _lock

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    @property
    def hit_rate(self) -> float:
        """Hits over look-ups so far (0 before the first)."""
        with self._lock:
            total = self.hits + self.misses
            return self.hits / total if total else 0.0

    def lookup(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(hit bool [N], values float32 [N], priors float32 [N, A] or None) for
        observations uint8 [N, 2, 6, 7]; values and priors are 0 where missed,
        priors None when no hit carried any."""
        keys = _keys(obs)
        hit = np.zeros(len(keys), bool)
        values = np.zeros(len(keys), np.float32)
        priors: list[bytes | None] = [None] * len(keys)
        with self._lock:
            for i, k in enumerate(keys):
                entry = self._table.get(k)
                if entry is not None:
                    self._table.move_to_end(k)
                    hit[i], values[i], priors[i] = True, entry[0], entry[1]
            n_hit = int(hit.sum())
            self.hits += n_hit
            self.misses += len(keys) - n_hit
        LOOKUPS.labels("hit").inc(n_hit)
        LOOKUPS.labels("miss").inc(len(keys) - n_hit)
        if not any(p is not None for p in priors):
            return hit, values, None
        out = np.zeros((len(keys), A), np.float32)
        for i, p in enumerate(priors):
            if p is not None:
                out[i] = np.frombuffer(p, np.float32)
        return hit, values, out

    def store(self, obs: np.ndarray, values: np.ndarray, priors: np.ndarray | None) -> None:
        """Keeps the answers for observations uint8 [N, 2, 6, 7]: values
        float32 [N], priors float32 [N, A] or None."""
        if self.capacity == 0:
            return
        keys = _keys(obs)
        vals = np.asarray(values, np.float32).reshape(-1).tolist()
        rows = [None] * len(keys) if priors is None else [np.asarray(p, np.float32).tobytes() for p in priors]
        with self._lock:
            for k, v, p in zip(keys, vals, rows):
                self._table[k] = (v, p)
                self._table.move_to_end(k)
            while len(self._table) > self.capacity:
                self._table.popitem(last=False)
            ENTRIES.set(len(self._table))


def _keys(obs: np.ndarray) -> list[bytes]:
    flat = np.ascontiguousarray(obs, np.uint8).reshape(len(obs), -1)
    return [row.tobytes() for row in flat]


class CachedEvaluator:
    """A leaf evaluator that answers from an :class:`EvaluationCache` what it
    can and asks ``inner`` for the rest, in one call (none when all hit).

    Args:
        inner: ``inner(obs uint8 [M, 2, 6, 7], deadline) -> (values float32 [M],
            priors float32 [M, A] or None)``; ``deadline`` is a
            :class:`~tandem.deadline.Deadline` or None. Raises EvaluationFailed.
        cache: where answers are kept.
    """

    def __init__(self, inner, cache: EvaluationCache):
        self.inner, self.cache = inner, cache

    def until(self, deadline: Deadline | None):
        """This evaluator with every model call bound by ``deadline`` (see RewardServiceEvaluator.until)."""
        return lambda observations: self(observations, deadline)

    def __call__(self, observations, deadline: Deadline | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Values float32 [N] and priors float32 [N, A] or None, for observations uint8 [N, 2, 6, 7].

        Raises:
            EvaluationFailed: the inner evaluator failed on the misses.
        """
        obs = np.asarray(observations, np.uint8)
        hit, values, priors = self.cache.lookup(obs)
        miss = np.flatnonzero(~hit)
        if miss.size == 0:
            return values, priors
        v, p = self.inner(obs[miss], deadline)
        v = np.asarray(v, np.float32).reshape(-1)
        self.cache.store(obs[miss], v, p)
        values[miss] = v
        if p is None:
            return values, None  # a value-only model: no hit carried priors either
        if priors is None:
            priors = np.zeros((len(obs), A), np.float32)
        priors[miss] = p
        return values, priors

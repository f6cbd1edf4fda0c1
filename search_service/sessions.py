"""Trees kept between consecutive moves of one game, by session id.

A session remembers the move string its tree is rooted at. When the next
request's move string extends it, the tree is re-rooted at the position those
extra moves reach (the played child is promoted to root); anything else starts
a fresh tree. Least recently used sessions go first when ``max_sessions`` is
reached, and any session unused for ``ttl_ms`` is dropped.

Thread safety: ``_lock`` guards ``_entries``. A tree is *taken* out of the store
while a search runs on it, so two concurrent requests of one session never
share a tree (the second simply starts fresh).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class _Entry:
    moves: str
    tree: Any
    used: float  # time.monotonic() of the last use


class SessionStore:
    def __init__(self, max_sessions: int, ttl_ms: float):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_ms / 1000.0
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # guarded by _lock

    def take(self, session_id: str, moves: str, reroot: Callable[[Any, list[int]], Any]) -> Any | None:
        """Removes and returns the session's tree re-rooted at ``moves``, or None.

        ``reroot(tree, actions)`` promotes the child reached by the 0-based
        ``actions`` to root (or returns None when it is not in the tree).
        """
        with self._lock:
            self._expire()
            entry = self._entries.pop(session_id, None)
        if entry is None or not moves.startswith(entry.moves):
            return None
        extra = [int(c) - 1 for c in moves[len(entry.moves):]]
        return reroot(entry.tree, extra) if extra else entry.tree

    def put(self, session_id: str, moves: str, tree: Any) -> None:
        with self._lock:
            self._entries.pop(session_id, None)
            self._entries[session_id] = _Entry(moves, tree, time.monotonic())
            while len(self._entries) > self.max_sessions:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _expire(self) -> None:  # caller holds _lock
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.used >= cutoff:
                break
            del self._entries[key]

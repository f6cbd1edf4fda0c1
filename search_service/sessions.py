"""Trees kept between consecutive moves of one game, by session id.

A session remembers the move string its tree is rooted at. When the next
request's move string extends it, the tree is re-rooted at the position those
extra moves reach (the played child is promoted to root); anything else starts
a fresh tree. Least recently used sessions go first when ``max_sessions`` is
reached or the trees kept hold more than ``max_bytes`` together (a tree larger
than that alone is not kept), and any session unused for ``ttl_ms`` is dropped.

Thread safety: ``_lock`` guards ``_entries`` and ``_bytes``. A tree is *taken*
out of the store while a search runs on it, so two concurrent requests of one
session never share a tree (the second simply starts fresh).
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
    nbytes: int  # memory the tree holds (tree_bytes)


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays a kept tree holds alive: the NumPy pools of a
    ``search_service.mcts.tree.Tree``, the device pool of a ``CudaTree``."""
    fields = getattr(tree, "__slots__", None)
    values = [getattr(tree, name) for name in fields] if fields else vars(tree).values()
    return sum(int(getattr(v, "nbytes", 0)) for v in values)


class SessionStore:
    """Args:
        max_sessions: trees kept at most (count).
        ttl_ms: a tree unused this long (ms) is dropped.
        max_bytes: the trees kept hold at most this many bytes together
            (:func:`tree_bytes`); None: no byte bound.
    """

    def __init__(self, max_sessions: int, ttl_ms: float, max_bytes: int | None = None):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_ms / 1000.0
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # guarded by _lock
        self._bytes = 0  # guarded by _lock: the kept trees' tree_bytes, summed

    def take(self, session_id: str, moves: str, reroot: Callable[[Any, list[int]], Any]) -> Any | None:
        """Removes and returns the session's tree re-rooted at ``moves``, or None.

        ``reroot(tree, actions)`` promotes the child reached by the 0-based
        ``actions`` to root (or returns None when it is not in the tree).
        """
        with self._lock:
            self._expire()
            entry = self._pop(session_id)
        if entry is None or not moves.startswith(entry.moves):
            return None
        extra = [int(c) - 1 for c in moves[len(entry.moves):]]
        return reroot(entry.tree, extra) if extra else entry.tree

    def put(self, session_id: str, moves: str, tree: Any) -> bool:
        """Keeps ``tree`` for the session (least recently used ones go to make
        room). Returns False when the tree alone is larger than ``max_bytes``
        (it is not kept)."""
        nbytes = tree_bytes(tree)
        with self._lock:
            self._pop(session_id)
            if self.max_bytes is not None and nbytes > self.max_bytes:
                return False
            self._entries[session_id] = _Entry(moves, tree, time.monotonic(), nbytes)
            self._bytes += nbytes
            while len(self._entries) > self.max_sessions or (self.max_bytes is not None and self._bytes > self.max_bytes):
                self._pop(next(iter(self._entries)))
        return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the kept trees hold (:func:`tree_bytes`, summed)."""
        with self._lock:
            return self._bytes

    def _pop(self, session_id: str) -> _Entry | None:  # caller holds _lock
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry

    def _expire(self) -> None:  # caller holds _lock
        cutoff = time.monotonic() - self.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.used >= cutoff:
                break
            self._pop(key)

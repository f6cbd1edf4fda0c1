"""Trees kept between consecutive moves of one game, by owner and session id.

A session remembers the move string its tree is rooted at. When the next
request's move string extends it, the tree is re-rooted at the position those
extra moves reach (the played child is promoted to root); anything else starts
a fresh tree. Least recently used sessions go first when ``max_sessions`` is
reached or the trees kept hold more than ``max_bytes`` together (a tree larger
than that alone is not kept), and any session unused for ``ttl_ms`` is dropped.

A session belongs to the caller that first named it: the store is keyed by
(:func:`owner`, game, session id), so a caller of another user naming the same id
names a session of its own, and can neither continue, reset nor end the
first caller's tree (see :func:`owner` for who counts as one caller). Within
one owner, a session is bound to the connection (its gRPC peer string) that
first named it, for as long as the session is kept: a search naming it from
another connection that is still open (:func:`tandem.peer.connection_open`)
is answered from a fresh tree, which is not kept, and the session's tree
stays as it was. Once the binding connection is closed, the next connection
naming the id takes the session over, tree and all: an engine that
reconnects keeps its tree. Where a connection's state cannot be told (a
remote or Unix-socket peer), it is never taken for closed: such an engine
that reconnects starts a fresh tree under a new binding once the old one is
dropped (``ttl_ms`` unused, or least recently used).

Thread safety: ``_lock`` guards ``_entries`` and ``_bytes``. A tree is *taken*
out of its entry while a search runs on it, so two concurrent requests of one
session never share a tree (the second simply starts fresh); the entry, and
so the binding, stays.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from tandem import peer as peers


@dataclass
class _Entry:
    moves: str
    tree: Any  # None while a search holds it, or none was kept
    used: float  # time.monotonic() of the last use
    nbytes: int  # memory the tree holds (tree_bytes)
    connection: str  # the gRPC peer string of the connection the session is bound to


def tree_bytes(tree: Any) -> int:
    """Bytes of the arrays a kept tree holds alive: the NumPy pools of a
    ``search_service.mcts.tree.Tree``, the device pool of a ``CudaTree``;
    0 for None (a backend that gives no tree back: a game folder's on the
    CUDA backend, search_service/cuda/game_batch.py)."""
    if tree is None:
        return 0
    fields = getattr(tree, "__slots__", None)
    values = [getattr(tree, name) for name in fields] if fields else vars(tree).values()
    return sum(int(getattr(v, "nbytes", 0)) for v in values)


def owner(peer: str, local_port: int = 0) -> Hashable:
    """Who owns the sessions a gRPC peer (``context.peer()``) names: on this
    host, the user owning the client's socket (``("uid", 1000)``); a remote
    peer, its address without the port (``("host", "10.0.0.5")``, the best a
    shared token leaves); a peer whose user cannot be told (a Unix socket, a
    connection already gone) ``("unknown",)``, one owner for all of them.

    Clients of one user are one owner: they are kept apart only by choosing
    session ids the others cannot guess (128 random bits, ``uuid.uuid4()``).
    ``local_port``: the server's port, for the kernel's exact lookup of the
    connection (tandem/peer.py: tens of µs); 0: /proc/net/tcp{,6} are read
    instead (2-4 ms on a VM; see :class:`Owners`).
    """
    uid = peers.uid(peer, local_port)
    if uid is not None:
        return ("uid", uid)
    p = peers.parse(peer)
    if p.scheme in ("ipv4", "ipv6") and not p.local:
        return ("host", p.host)
    return ("unknown",)


class Owners:
    """:func:`owner` of each caller. Once ``local_port`` (the server's port) is
    set, every call asks the kernel for its own connection (exact, no memory);
    before, :func:`owner` is remembered per peer address for ``ttl_s`` seconds,
    so that a game's moves do not each read /proc/net/tcp (milliseconds of a frame).

    Within ``ttl_s`` of a lookup, a new connection from the same address and
    port is taken for the same user: only after the first one closed and
    another user bound its port (on loopback the kernel lets a port in
    TIME_WAIT be reused after 1 s), so keep ``ttl_s`` at about a second.
    At most ``max_entries`` peers are remembered (the oldest go first).
    Thread safe.
    """

    def __init__(self, ttl_s: float = 1.0, max_entries: int = 4096):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, tuple[float, Hashable]] = OrderedDict()  # guarded by _lock
        self.local_port = 0  # set once the server listens (one int write; read anywhere)

    def gone(self, connection: str) -> bool:
        """Whether the connection ``connection`` (a gRPC peer string) is known
        to be closed (:func:`tandem.peer.connection_open`; never before
        ``local_port`` is set)."""
        return peers.connection_open(connection, self.local_port) is False

    def __call__(self, peer: str) -> Hashable:
        if self.local_port:
            return owner(peer, self.local_port)
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(peer)
        if hit is not None and now - hit[0] < self.ttl_s:
            return hit[1]
        found = owner(peer)
        if found[0] == "uid":  # a failed lookup is not remembered: the next call tries again
            with self._lock:
                self._seen.pop(peer, None)
                self._seen[peer] = (now, found)
                while len(self._seen) > self.max_entries:
                    self._seen.popitem(last=False)
        return found


class SessionStore:
    """Args:
        max_sessions: sessions kept at most (count; with their trees or, while
            a search holds the tree, their binding alone).
        ttl_ms: a session unused this long (ms) is dropped.
        max_bytes: the trees kept hold at most this many bytes together
            (:func:`tree_bytes`); None: no byte bound.
    """

    def __init__(self, max_sessions: int, ttl_ms: float, max_bytes: int | None = None):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_ms / 1000.0
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # guarded by _lock
        self._bytes = 0  # guarded by _lock: the kept trees' tree_bytes, summed

    def take(self, key: Hashable, moves: str, reroot: Callable[[Any, str], Any], connection: str = "",
             gone: Callable[[str], bool] = lambda connection: False) -> tuple[Any | None, bool]:
        """The session's tree re-rooted at ``moves`` (taken out of the store;
        None: none to continue), and whether the caller holds the session.

        ``key``: the session's (:func:`owner`, game, session id);
        ``connection``: the caller's gRPC peer string. A session nobody holds
        is bound to ``connection``; one bound to another connection is taken
        over when ``gone(that connection)`` (called outside the lock) says it
        is closed, else the answer is (None, False): the caller gets no tree
        and must not :meth:`put` one. ``reroot(tree, extra)`` promotes the
        node that the moves ``extra`` (the end of ``moves`` past the tree's
        own, in the game's notation) reach to root (or returns None when it
        is not in the tree).
        """
        with self._lock:
            self._expire()
            entry = self._entries.get(key)
            holder = entry.connection if entry is not None else connection
        if holder != connection and not gone(holder):
            return None, False
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._keep(key, _Entry("", None, time.monotonic(), 0, connection))
                return None, True
            if entry.connection not in (connection, holder):  # bound anew meanwhile
                return None, False
            entry.connection, entry.used, tree, rooted = connection, time.monotonic(), entry.tree, entry.moves
            entry.tree, self._bytes, entry.nbytes = None, self._bytes - entry.nbytes, 0
            self._entries.move_to_end(key)
        if tree is None or not moves.startswith(rooted):
            return None, True
        extra = moves[len(rooted):]
        return (reroot(tree, extra) if extra else tree), True

    def put(self, key: Hashable, moves: str, tree: Any, connection: str = "") -> bool:
        """Keeps ``tree`` for the session ``key`` of ``connection`` (as in
        :meth:`take`; least recently used sessions go to make room). Returns
        False when it is not kept: the tree alone is larger than ``max_bytes``
        (the session stays bound, without a tree), or the session is bound to
        another connection."""
        nbytes = tree_bytes(tree)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.connection != connection:
                return False
            self._pop(key)
            fits = self.max_bytes is None or nbytes <= self.max_bytes
            self._keep(key, _Entry(moves, tree if fits else None, time.monotonic(), nbytes if fits else 0, connection))
        return fits

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the kept trees hold (:func:`tree_bytes`, summed)."""
        with self._lock:
            return self._bytes

    def _keep(self, key: Hashable, entry: _Entry) -> None:  # caller holds _lock
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while len(self._entries) > self.max_sessions or (self.max_bytes is not None and self._bytes > self.max_bytes):
            self._pop(next(iter(self._entries)))

    def _pop(self, key: Hashable) -> _Entry | None:  # caller holds _lock
        entry = self._entries.pop(key, None)
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
